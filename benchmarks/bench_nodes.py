"""Training across emulated nodes: step time and bytes across each node's link, framework by framework.

Nodes are network namespaces joined by tbf-shaped veth links (emulated_nodes.py; needs root), one
torchrun per node; traffic between ranks of one node stays on the node (shared memory, loopback), so
the link's counters count exactly the node-to-node bytes. Every framework trains bench_step's
GPT-NeoX from the same seed on the same global batch (nodes_worker.py): fp32 AdamW, clipping 1.0,
k micro-batches of B x T tokens per rank, gradient sync only on the last micro-batch.

    shardpar-node   shardpar, sdp = ranks per node: one sharding group per node, nodes are replicas
    shardpar-span   shardpar, sdp = world: the sharding group spans the nodes
    fsdp2-full      FSDP2 fully_shard over the world (flat)
    fsdp2-hsdp      FSDP2 HSDP, mesh (nodes, ranks per node)
    ddp             DistributedDataParallel (no_sync but on the last micro-batch)
    deepspeed-z3    DeepSpeed ZeRO-3 over the world (if deepspeed runs here)
    deepspeed-mics  DeepSpeed MiCS, mics_shard_size = ranks per node (if this deepspeed still has it)

    sudo .venv/bin/python benchmarks/bench_nodes.py --nodes 2 --ranks-per-node 2 --rate-mbit 300 \\
        --model 25m --accum 4 --batch 2 --seq 128 --steps 3 --scaling 1,2

Bytes are per step, out of node 0's link (node 0 -> node 1 with 2 nodes; with more, every node's
egress into the hub's bridge is printed), beside two figures of the same layout: `model` = what the
implementation's algorithms move (gloo rings in rank order, gloo's reduce_scatter being an all-reduce),
and `minimum` = what the layout must move at least (docs/performance.md, "Across nodes").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import emulated_nodes

FRAMEWORKS = (
    "shardpar-node",
    "shardpar-span",
    "shardpar-span-min",
    "shardpar-span-int8",
    "fsdp2-full",
    "fsdp2-hsdp",
    "ddp",
    "deepspeed-z3",
    "deepspeed-mics",
)
SPAN = ("shardpar-span", "shardpar-span-min", "shardpar-span-int8")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nodes_worker.py")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A p4d.24xlarge: 8 A100s at 312 TFLOP/s dense bf16 each, 400 Gbit/s EFA per instance (50 per GPU).
P4D_FLOPS_PER_GPU = 312e12
P4D_BYTES_PER_S_PER_GPU = 400e9 / 8 / 8
P4D_FLOP_PER_BYTE = P4D_FLOPS_PER_GPU / P4D_BYTES_PER_S_PER_GPU  # 49,920


# ---- analytical bytes -----------------------------------------------------------------------------


def _ring_allreduce(size: float, ranks: int) -> float:
    """Bytes each edge of a ring all-reduce carries; ranks are contiguous per node, so exactly one
    edge leaves each node."""
    return 2 * (ranks - 1) / ranks * size


def _ring_allgather(out_size: float, ranks: int) -> float:
    return (ranks - 1) / ranks * out_size


def _node_share(size: float, nodes: int) -> float:
    """What a node must send at least so every other node sees its part of `size` (a gather across
    nodes, or each half of an all-reduce across nodes)."""
    return (nodes - 1) / nodes * size


def shardpar_span_minimum(*, params: int, nodes: int, ranks_per_node: int, accum: int, dtype_bytes: int = 4) -> int:
    """A sharding group spanning the nodes must bring each node the rest of the model once a step (one
    gather) and send the rest of its gradient sums once (one ReduceScatter): 2 x (N-1)/N of the model,
    4P for two nodes -- what the node-local layout's replica AllReduce moves. shardpar sends exactly
    that with sdp_node_secondary_shard and sdp_defer_cross_node_reduce (cli/cross_node.py)."""
    return int(2 * _node_share(dtype_bytes * params, nodes))


def span_formula() -> Callable[..., int]:
    return shardpar_span_minimum


def analytical_cross_node_bytes(
    layout: str,
    params: int,
    *,
    nodes: int,
    ranks_per_node: int,
    accum: int,
    dtype_bytes: int = 4,
    span: Callable[..., int] | None = None,
) -> int:
    """The minimum bytes one node sends to the others per step under `layout` (node 0 -> node 1 with
    two nodes). Replicated layouts (DDP, and sharding inside a node with the nodes as replicas) must
    all-reduce the gradients across nodes once: 2 (N-1)/N x 4P, 4P for two nodes. Layouts sharded
    over the whole world in a flat ring of N x L ranks carry (n-1)/n of the parameters per gather
    over the ring's one edge out of each node: FSDP2 2k gathers + 1 reduce-scatter (no sync before
    the last micro-batch), ZeRO-3 2k gathers + k reduce-scatters. `span` gives shardpar spanning
    nodes (default: span_formula())."""
    size, world = dtype_bytes * params, nodes * ranks_per_node
    if nodes < 2:
        return 0
    if layout in ("ddp", "shardpar-node", "fsdp2-hsdp", "deepspeed-mics"):
        return int(_ring_allreduce(size, nodes))
    if layout == "fsdp2-full":
        return int((2 * accum + 1) * _ring_allgather(size, world))
    if layout == "deepspeed-z3":
        return int(3 * accum * _ring_allgather(size, world))
    if layout in SPAN:
        kw = {"params": params, "nodes": nodes, "ranks_per_node": ranks_per_node, "accum": accum}
        return (span or span_formula())(**kw, dtype_bytes=dtype_bytes)
    raise ValueError(f"unknown layout {layout!r}")


def modelled_bytes(layout: str, counts: dict[str, int], *, nodes: int, ranks_per_node: int, accum: int) -> int | None:
    """What the implementation moves here (gloo), per node and step, from its algorithms: rings in rank
    order, gloo's reduce_scatter_tensor as a full all-reduce (measured: 1.5 x the input at 4 ranks),
    the root unit (embeddings) gathered once per micro-batch, parameters under the persistence
    threshold all-reduced over the world. None where not modelled (DeepSpeed)."""
    P, pers, root, root_pers = (counts[k] for k in ("params", "persistent", "root", "root_persistent"))
    world, k, b = nodes * ranks_per_node, accum, 4
    if nodes < 2:
        return 0
    if layout in ("ddp",):
        return int(_ring_allreduce(b * P, world))
    if layout == "fsdp2-hsdp":
        return int(_ring_allreduce(b * P, nodes))
    if layout == "fsdp2-full":
        gathered = 2 * k * (P - root) + k * root
        return int(_ring_allgather(b * gathered, world) + _ring_allreduce(b * P, world))
    if layout == "shardpar-node":
        return int(_ring_allreduce(b * (P - pers), nodes) + _ring_allreduce(b * pers, world))
    if layout == "shardpar-span-before":  # before issue 28: hierarchical gathers, gloo's flat reduce-scatter
        layers, root_sharded = P - root - (pers - root_pers), root - root_pers
        gathered = 2 * k * layers + k * root_sharded
        reduce = k * _ring_allreduce(b * (P - pers), world)
        return int(_node_share(b * gathered, nodes) + reduce + _ring_allreduce(b * pers, world))
    return None


# ---- runs -----------------------------------------------------------------------------------------


def deepspeed_problem(framework: str) -> str:
    """Why this DeepSpeed layout cannot run here ('' when it can), checked in a child process."""
    probe = "import deepspeed.accelerator as a; assert a.get_accelerator()._name == 'cpu'"
    if framework == "deepspeed-mics":
        probe += "; from deepspeed.runtime.zero import mics"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode == 0:
        # a deepspeed that still has MiCS: nodes_worker.py has no layout for it yet
        return "" if framework == "deepspeed-z3" else "deepspeed-mics: no nodes_worker layout for this deepspeed's MiCS"
    last = (proc.stderr.strip().splitlines() or ["import failed"])[-1]
    if framework == "deepspeed-mics" and "mics" in last:
        return "this deepspeed has no MiCS (removed upstream: zero_optimization.mics_shard_size is rejected)"
    return f"deepspeed unusable: {last}"


def run_framework(nodes: emulated_nodes.EmulatedNodes, fw: str, args: argparse.Namespace) -> dict[str, Any]:
    argv = [WORKER, "--layouts", fw, "--model", args.model, "--accum", str(args.accum), "--batch", str(args.batch)]
    argv += ["--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    argv += ["--backend", args.backend]
    env = {"PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), "DS_ACCELERATOR": "cpu"}
    t0 = time.monotonic()
    ranks = emulated_nodes.launch(nodes, args.ranks_per_node, argv, env=env, timeout_s=args.timeout)
    per_rank = [r["layouts"][0] for r in ranks]
    readers = [lay for r, lay in zip(ranks, per_rank, strict=True) if r["local_rank"] == 0]  # one per node
    steps = range(len(per_rank[0]["times"]))
    return {
        "step_s": [max(lay["times"][i] for lay in per_rank) for i in steps],
        "tx": [lay["tx"] for lay in readers],  # per node, per step
        "rx": [lay["rx"] for lay in readers],
        "loss": [statistics.fmean(lay["loss"][i] for lay in per_rank) for i in steps],
        "wall_s": time.monotonic() - t0,
        "modelled": readers[0].get("modelled"),  # shardpar's own arithmetic (cli/cross_node.py), if shardpar
    }


def run_config(node_count: int, frameworks: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with emulated_nodes.EmulatedNodes(node_count, args.rate_mbit if node_count > 1 else None) as nodes:
        for fw in frameworks:
            row: dict[str, Any] = {"framework": fw, "nodes": node_count, "status": "ok"}
            why = deepspeed_problem(fw) if fw.startswith("deepspeed") else ""
            if why:
                row.update(status="skipped", error=why)
            else:
                try:
                    row.update(run_framework(nodes, fw, args))
                except emulated_nodes.LaunchError as err:
                    row.update(status="failed", error=str(err))
            print(_progress(row), flush=True)
            rows.append(row)
    return rows


def _progress(row: dict[str, Any]) -> str:
    head = f"{row['framework']:15s} {row['nodes']} node(s)"
    if row["status"] != "ok":
        return f"{head}: {row['status']}: {row['error'].strip().splitlines()[0] if row['error'] else ''}"
    mib = [statistics.median(tx) / 2**20 for tx in row["tx"]]
    return (
        f"{head}: median step {statistics.median(row['step_s']):.2f} s, link tx MiB/step {mib}, ({row['wall_s']:.0f} s)"
    )


# ---- report -------------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]], counts: dict[str, int], args: argparse.Namespace) -> str:
    lines = [
        "| framework | nodes x ranks | median step s | MiB/step out of each node | model MiB | minimum MiB "
        "| measured / minimum | loss (last) |",
        "|" + "---|" * 8,
    ]
    for row in rows:
        n, fw = row["nodes"], row["framework"]
        head = [fw, f"{n} x {args.ranks_per_node}"]
        if row["status"] != "ok":
            lines.append(
                "| " + " | ".join([*head, f"{row['status']}: {row['error'].strip().splitlines()[0]}"]) + " |||||"
            )
            continue
        kw = {"nodes": n, "ranks_per_node": args.ranks_per_node, "accum": args.accum}
        minimum = analytical_cross_node_bytes(fw, counts["params"], **kw)
        model = row.get("modelled") if fw.startswith("shardpar") else modelled_bytes(fw, counts, **kw)
        sent = [statistics.median(tx) for tx in row["tx"]] if n > 1 else [0.0]
        ratio = f"{max(sent) / minimum:.2f}" if minimum else "-"
        cells = [
            f"{statistics.median(row['step_s']):.2f}",
            " / ".join(f"{s / 2**20:.1f}" for s in sent),
            "-" if model is None else f"{model / 2**20:.1f}",
            f"{minimum / 2**20:.1f}",
            ratio,
            f"{row['loss'][-1]:.4f}",
        ]
        lines.append("| " + " | ".join(head + cells) + " |")
    return "\n".join(lines)


def rate_note(rows: list[dict[str, Any]], counts: dict[str, int], args: argparse.Namespace) -> str:
    """The link rate that gives this CPU p4d's compute-to-network ratio, from the fastest step with no
    link (1 node) -- or, without one, the fastest step measured (which then includes communication)."""
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return ""
    alone = [r for r in ok if r["nodes"] == 1] or ok
    best = min(alone, key=lambda r: statistics.median(r["step_s"]))
    tokens = args.accum * args.batch * args.seq  # per rank and step
    flops = 6 * counts["params"] * tokens / statistics.median(best["step_s"])  # per rank
    mbit = flops * args.ranks_per_node / P4D_FLOP_PER_BYTE * 8 / 1e6
    step = statistics.median(best["step_s"])
    return (
        f"compute: {flops / 1e9:.1f} GFLOP/s per rank (6 P x {tokens} tokens / {step:.2f} s, "
        f"{best['framework']} on {best['nodes']} node(s)); p4d: {P4D_FLOP_PER_BYTE:,.0f} FLOP per network byte "
        f"(312 TFLOP/s per A100 / 50 Gbit/s per GPU) -> a node of {args.ranks_per_node} ranks here matches p4d's "
        f"ratio at {mbit:.1f} Mbit/s (this run: {args.rate_mbit:g} Mbit/s, {args.rate_mbit / mbit:.0f}x that)"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--rate-mbit", type=float, default=300.0, help="each direction of each link")
    p.add_argument("--model", default="25m", choices=("small", "25m"))
    p.add_argument("--accum", type=int, default=4, help="micro-batches per step")
    p.add_argument("--batch", type=int, default=2, help="sequences per micro-batch and rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="measured steps")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS[:5]), help="subset of " + ",".join(FRAMEWORKS))
    p.add_argument("--scaling", default="", help="weak scaling: node counts (e.g. 1,2,4), each with sdp = node")
    p.add_argument("--scaling-frameworks", default="shardpar-node,fsdp2-hsdp,ddp")
    p.add_argument("--backend", default="auto", help="shardpar's ddp_dist_backend")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per framework run")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    for name in ("frameworks", "scaling_frameworks"):
        bad = [f for f in getattr(args, name).split(",") if f and f not in FRAMEWORKS]
        if bad:
            p.error(f"--{name.replace('_', '-')}: {bad} not in {FRAMEWORKS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ok, why = emulated_nodes.available()
    if not ok:
        print(f"bench_nodes: {why}")
        return 2
    from nodes_worker import params_count  # imports torch

    counts = params_count(args.model, 1000)
    print(f"bench_nodes: {args.model} = {counts['params']:,} parameters; command: {' '.join(sys.argv)}", flush=True)
    wanted = [f for f in args.frameworks.split(",") if f]  # empty: only the weak scaling
    rows = run_config(args.nodes, wanted, args) if wanted else []
    scaling: list[dict[str, Any]] = []
    for count in [int(c) for c in args.scaling.split(",") if c]:
        scaling += run_config(count, [f for f in args.scaling_frameworks.split(",") if f], args)
    if rows:
        print(f"\n{table(rows, counts, args)}")
    if scaling:
        head = f"weak scaling ({args.ranks_per_node} ranks per node, same batch per rank)"
        print(f"\n{head}:\n{table(scaling, counts, args)}")
    print("\n" + rate_note(rows + scaling, counts, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "counts": counts, "rows": rows, "scaling": scaling}, f, indent=1)
    return 0 if all(r["status"] != "failed" for r in rows + scaling) else 1


if __name__ == "__main__":
    raise SystemExit(main())
