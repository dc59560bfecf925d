"""Bytes across nodes, pinned by link counters (issue 28): 2 emulated nodes x 2 ranks.

Two network namespaces joined by a tbf-shaped veth (benchmarks/emulated_nodes.py, needs root, `ip`,
`tc`), one torchrun per node. One launch runs every layout in turn in the same processes (start-up
paid once): a probe of single collectives, then DDP, shardpar with sdp = node size (the nodes are
replicas) and shardpar with sdp spanning both nodes (defaults, and with the knobs that send the
minimum), each 1 warm-up + 1 measured step of the small
GPT-NeoX with 2 micro-batches. Asserted: node-local traffic does not cross the link; each layout's
bytes out of each node per step are within 5 % of the analytical figure -- shardpar's its own
arithmetic, shardpar.cli.cross_node (the link counters include
frame headers, ~0.1 % at MTU 9000, and barriers, ~1 KiB); losses and final parameters match one
process training on the whole batch. Nothing here depends on time.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
sys.path.append(BENCH)
import bench_nodes  # noqa: E402  (benchmarks/ is not a package)
import emulated_nodes  # noqa: E402
from nodes_worker import global_micro_batches, params_count  # noqa: E402
from step_setups import build_model  # noqa: E402

NODES, LOCAL, ACCUM, BATCH, SEQ, WARMUP, STEPS = 2, 2, 2, 2, 64, 1, 1
LR, EPS, CLIP = 1e-3, 1e-6, 1.0  # eps 1e-6: see [Note: Adam eps in parity tests] (tests/multiproc/parity.py)
LAYOUTS = ("ddp", "shardpar-node", "shardpar-span", "shardpar-span-min")
BYTES_TOL = 0.05
PARITY_TOL = 1e-5  # as tests/multiproc/test_parity.py
RATE_MBIT = 2000.0  # bytes do not depend on the rate; a fast link keeps the run short

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ok, why = emulated_nodes.available()
    if not ok:
        pytest.skip(why)
    params_dir = tmp_path_factory.mktemp("node_params")
    argv = [os.path.join(BENCH, "nodes_worker.py"), "--layouts", ",".join(("probe", *LAYOUTS)), "--model", "small"]
    argv += ["--accum", str(ACCUM), "--batch", str(BATCH), "--seq", str(SEQ), "--warmup", str(WARMUP)]
    argv += ["--steps", str(STEPS), "--lr", str(LR), "--eps", str(EPS), "--clip", str(CLIP)]
    argv += ["--save-params", str(params_dir), "--probe-mib", "4"]
    repo = os.path.dirname(BENCH)
    env = {"PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    with emulated_nodes.EmulatedNodes(NODES, RATE_MBIT) as nodes:
        try:
            ranks = emulated_nodes.launch(nodes, LOCAL, argv, env=env, timeout_s=600)
        except emulated_nodes.LaunchError as err:
            pytest.fail(f"emulated 2-node run failed: {err}")
    layouts: dict[str, list[dict[str, Any]]] = {}
    for r in ranks:
        for lay in r["layouts"]:
            layouts.setdefault(lay["layout"], []).append({**lay, "local_rank": r["local_rank"]})
    return {"layouts": layouts, "params_dir": str(params_dir)}


def _sent(run: dict[str, Any], layout: str) -> list[int]:
    """Bytes out of each node's link, every measured step (read by each node's local rank 0)."""
    return [tx for lay in run["layouts"][layout] if lay["local_rank"] == 0 for tx in lay["tx"]]


def test_node_local_traffic_stays_off_the_link(run: dict[str, Any]) -> None:
    probe = [lay for lay in run["layouts"]["probe"] if lay["local_rank"] == 0]
    for node in probe:
        size = node["bytes"]
        # a gloo all_reduce between the two ranks of a node goes to the node's own address: lo
        assert max(node["all_reduce_node_local"]) < 16 * 1024, node
        # the same over the world: a ring of 4 in rank order, one edge out of each node, 2 x 3/4 of it
        # (within BYTES_TOL, as every byte figure here: on top of the frame headers a tbf queue that
        # overflows drops a segment, and TCP sends it again -- seen once at +1.2 % on a loaded machine)
        assert node["all_reduce_world"][0] == pytest.approx(1.5 * size, rel=BYTES_TOL), node
        assert node["all_gather_world"][0] == pytest.approx(3 * size, rel=BYTES_TOL), node  # 3/4 of 4 x size


def _expected(run: dict[str, Any], layout: str) -> float:
    """DDP: gloo's flat ring over the 4 ranks (1.5 x 4P, not the hierarchical 4P). shardpar: its own
    arithmetic for the model it built (shardpar.cli.cross_node.model_traffic, reported by the worker),
    the figure `shardpar estimate --link-gbps` prints."""
    if layout == "ddp":
        counts = params_count("small", 1000)
        figure = bench_nodes.modelled_bytes("ddp", counts, nodes=NODES, ranks_per_node=LOCAL, accum=ACCUM)
        assert figure is not None
        return figure
    (modelled,) = {lay["modelled"] for lay in run["layouts"][layout] if lay["local_rank"] == 0}
    return float(modelled)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cross_node_bytes_match_the_analytical_figure(run: dict[str, Any], layout: str) -> None:
    sent = _sent(run, layout)
    assert len(sent) == NODES * STEPS
    expected = _expected(run, layout)
    for got in sent:
        assert abs(got - expected) <= BYTES_TOL * expected, f"{layout}: {got} bytes per step, analytical {expected}"


def test_spanning_group_with_both_knobs_sends_what_the_node_local_layout_does(run: dict[str, Any]) -> None:
    # sdp_node_secondary_shard + sdp_defer_cross_node_reduce: one gather and one ReduceScatter of the model
    # cross per step, the bytes of the node-local layout's replica AllReduce (4P for two nodes)
    span, node, plain = (max(_sent(run, lay)) for lay in ("shardpar-span-min", "shardpar-node", "shardpar-span"))
    assert span <= 1.05 * node, (span, node)
    assert plain > 2 * span, (plain, span)  # two micro-batches: 2 x (fwd + bwd) gathers, 2 cross hops


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole global batch: losses of the measured steps and the final parameters."""
    torch.manual_seed(0)
    model = build_model("small", SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(WARMUP + STEPS):
        total = 0.0
        for mb in global_micro_batches(step, ACCUM, BATCH * NODES * LOCAL, SEQ):
            loss = model(**mb).loss
            (loss / ACCUM).backward()
            total += loss.item() / ACCUM
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses[WARMUP:], {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_parity_with_one_process(run: dict[str, Any], reference: Any, layout: str) -> None:
    ref_losses, ref_params = reference
    ranks = run["layouts"][layout]
    losses = [sum(r["loss"][i] for r in ranks) / len(ranks) for i in range(STEPS)]  # equal rows per rank
    assert losses == pytest.approx(ref_losses, abs=PARITY_TOL)
    params = torch.load(os.path.join(run["params_dir"], f"{layout}.pt"))
    assert set(params) >= {k for k in ref_params if not k.endswith("inv_freq")}
    diff = max((params[k] - v.float()).abs().max().item() for k, v in ref_params.items() if k in params)
    assert diff <= PARITY_TOL, f"{layout}: max param diff {diff:.2e}"
