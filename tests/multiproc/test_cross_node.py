"""Sharding groups that span nodes (issue 28), on one host with ranks_per_node=2 as two "nodes": which
collectives cross nodes and how many bytes, counted by the engine, against cli/cross_node.py's
arithmetic; parity with one process is test_parity.py's (the same layouts). The emulated-node test
(test_nodes.py) reads the same figures from a shaped link's counters."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

import shardpar as smp
from shardpar.cli.cross_node import model_traffic
from tests import models

SPAN = {"sharded_data_parallel_degree": 4, "ranks_per_node": 2, "sdp_param_persistence_threshold": 10}
ACCUM = 2
BOTH = {"sdp_defer_cross_node_reduce": True, "sdp_node_secondary_shard": True}


def _one_step(knobs: dict[str, Any]) -> dict[str, Any]:
    """Two optimizer steps of accumulation 2; the second step's records, per (op, group kind)."""
    smp.init({"sdp_gradient_clipping": 1.0, **knobs})
    try:
        model = smp.DistributedModel(models.tiny_neox(), backward_passes_per_step=ACCUM)
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        stats, r = smp.comm_stats(), smp.rdp_rank()
        for step in range(2):
            stats.begin_step()
            for micro in range(ACCUM):
                batch = models.lm_batch(10 * step + micro, 2 * smp.rdp_size())
                local = {k: v[2 * r : 2 * r + 2] for k, v in batch.items()}
                model.backward(model(**local).loss / ACCUM)
            opt.step()
            opt.zero_grad()
        calls: Counter[tuple[str, str]] = Counter()
        nbytes: Counter[tuple[str, str]] = Counter()
        for rec in stats.history[-1]:
            calls[(rec.op, rec.group)] += 1
            nbytes[(rec.op, rec.group)] += rec.bytes
        groups = {k: g.ranks for k, g in smp.get_topology().groups.items()}
        expected = model_traffic(model, ACCUM)
        sharded = sum(u.layout.padded_numel for u in model.units)
        return {"calls": dict(calls), "bytes": dict(nbytes), "groups": groups, "expected": expected, "sharded": sharded}
    finally:
        smp.shutdown()


def _node0_sends(results: list[dict[str, Any]]) -> float:
    """What node 0's ranks (0 and 1) hand to collectives whose peers are on node 1: (n-1)/n of a gather's
    output or a ReduceScatter's input on the cross-node groups, 2 (n-1)/n of an AllReduce over 2 replicas."""
    total = 0.0
    for res in results[:2]:
        for (op, kind), nbytes in res["bytes"].items():
            ranks = res["groups"][kind]
            if (
                len({r // 2 for r in ranks}) == 1
                or kind in ("rdp", "world")
                or (op, kind) == ("all_reduce", "sharding")
            ):
                continue  # inside the node; the persistent grads' and the clipping norm's AllReduces (a few bytes)
            n = len(ranks)
            total += nbytes * (n - 1) / n * (2 if op == "all_reduce" else 1)
    return total


def test_spanning_group_sends_its_minimum_across_nodes(ranks) -> None:
    cases = [
        ("two-hop", {**SPAN}),
        ("boundary", {**SPAN, "sdp_defer_cross_node_reduce": True}),
        ("boundary+secondary", {**SPAN, **BOTH}),
        ("node-local", {**SPAN, "sharded_data_parallel_degree": 2}),
        ("int8", {**SPAN, **BOTH, "sdp_quantize_cross_node_weights": True, "sdp_quantize_cross_node_gradients": True}),
    ]
    per_case = {name: ranks.run(4, _one_step, knobs) for name, knobs in cases}
    two_hop = per_case["two-hop"][0]
    sharded = two_hop["sharded"]
    # No flat ReduceScatter over the spanning group: the node hop, then the cross hop of 1/2 of it.
    assert ("reduce_scatter", "sharding") not in two_hop["calls"]
    assert two_hop["calls"][("reduce_scatter", "sharding_cross")] == ACCUM  # one bucket, every backward
    assert two_hop["bytes"][("reduce_scatter", "sharding_cross")] == ACCUM * sharded // 4 * 2 * 4
    assert two_hop["bytes"][("reduce_scatter", "sharding_node_reduce")] == ACCUM * sharded * 4
    boundary = per_case["boundary"][0]
    assert boundary["calls"][("reduce_scatter", "sharding_cross")] == 1  # the window's one cross hop
    secondary = per_case["boundary+secondary"][0]
    # every unit crosses nodes once a step; the node hop still gathers every use
    assert secondary["calls"][("all_gather", "sharding_cross")] == 3
    assert secondary["calls"][("all_gather", "sharding_node")] == two_hop["calls"][("all_gather", "sharding_node")]
    for name, results in per_case.items():
        expected = results[0]["expected"]
        assert _node0_sends(results) == expected.total - expected.persistent, name
    totals = {name: results[0]["expected"].total for name, results in per_case.items()}
    # with both knobs the spanning group sends what the node-local layout's replica AllReduce does
    assert totals["boundary+secondary"] <= totals["node-local"] * 1.01, totals
    assert totals["two-hop"] > totals["boundary"] > totals["boundary+secondary"], totals
    # int8 blocks and their scales: about a quarter of the fp32 bytes (plus padding to whole blocks)
    int8 = per_case["int8"][0]
    assert ("reduce_scatter", "sharding_cross") not in int8["calls"] and int8["calls"][
        ("all_to_all", "sharding_cross")
    ] == 2
    assert totals["int8"] <= 0.3 * totals["boundary+secondary"], totals
