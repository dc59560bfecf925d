"""Rank arithmetic: the reference's 32-rank example verbatim, and invariants over many layouts."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpar.topology import GROUP_KINDS, plan


def test_reference_32_rank_example_verbatim() -> None:
    # Reference 003, "Sharded data parallelism with tensor parallelism", Example 2.
    p = plan(32, tp=4, sdp=4, ranks_per_node=8)
    assert p.tp_groups == tuple(tuple(range(i, i + 4)) for i in range(0, 32, 4))
    assert p.rdp_groups[0] == (0, 4, 8, 12, 16, 20, 24, 28)
    assert p.sharding_groups[:2] == ((0, 4, 8, 12), (16, 20, 24, 28))
    assert p.replication_groups[:4] == ((0, 16), (4, 20), (8, 24), (12, 28))
    assert p.num_replicas == 2 and p.rdp == 8
    # Sharding groups of the other TP ranks follow the same pattern, shifted.
    assert (1, 5, 9, 13) in p.sharding_groups and (3, 7, 11, 15) in p.sharding_groups
    # With 8 ranks a node, sharding group (0,4,8,12) spans nodes 0 and 1.
    assert p.spans_nodes
    assert p.groups_of(4)["sharding_node"] == (0, 4)
    assert p.groups_of(4)["sharding_cross"] == (4, 12)


def test_reference_1536_rank_example_plans_fast() -> None:
    # Reference 003, Example 1: 192 nodes x 8 GPUs, sdp 32, then with tp 8. "Fast" is counted, not
    # timed: the Python calls (generator steps included) planning makes stay linear in the world --
    # about 7 per rank per plan today; anything quadratic would be ~1536 per rank.
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        for tp in (1, 8):
            p = plan(1536, tp=tp, sdp=32, ranks_per_node=8)
            for kind in GROUP_KINDS:
                p.all_groups(kind)
            p.groups_of(1535)
    finally:
        sys.setprofile(None)
    assert calls <= 20 * 1536 * 2, f"planning 1536 ranks twice made {calls} Python calls"
    assert plan(1536, tp=8, sdp=32, ranks_per_node=8).num_replicas == 6


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, int, int, int]:
    world = draw(st.integers(1, 1024))
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    tp = draw(st.sampled_from(divisors))
    rdp = world // tp
    sdp = draw(st.sampled_from([d for d in range(1, rdp + 1) if rdp % d == 0]))
    rpn = draw(st.sampled_from(divisors))
    return world, tp, sdp, rpn


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_layout_invariants(layout: tuple[int, int, int, int]) -> None:
    world, tp, sdp, rpn = layout
    p = plan(world, tp=tp, sdp=sdp, ranks_per_node=rpn)
    expected_size = {
        "world": world,
        "tp": tp,
        "rdp": world // tp,
        "sharding": sdp,
        "replication": world // tp // sdp,
        "node": rpn,
    }
    for kind, size in expected_size.items():
        groups = p.all_groups(kind)
        members = sorted(r for g in groups for r in g)
        assert members == list(range(world)), f"{kind}: each rank exactly once"
        assert all(len(g) == size for g in groups), kind
    for g in p.sharding_groups:
        rdp_group = next(r for r in p.rdp_groups if g[0] in r)
        start = rdp_group.index(g[0])
        assert rdp_group[start : start + sdp] == g, "sharding group contiguous inside its rdp group"
    for g in p.replication_groups:
        positions = {p.coords(r).sdp_rank for r in g}
        tps = {p.coords(r).tp_rank for r in g}
        assert len(positions) == 1 and len(tps) == 1, "replication = same position, same tp rank"
    # The O(1) per-rank view agrees with the full lists, for a few ranks.
    for rank in {0, world - 1, world // 2}:
        mine = p.groups_of(rank)
        for kind in ("tp", "rdp", "sharding", "replication", "node"):
            assert mine[kind] in p.all_groups(kind) and rank in mine[kind], kind
        c = p.coords(rank)
        assert mine["sharding"][c.sdp_rank] == rank and mine["tp"][c.tp_rank] == rank
    # Hierarchical split: when it exists, node part x cross part reproduces the sharding group.
    for rank in {0, world - 1}:
        mine = p.groups_of(rank)
        if mine["sharding_node"]:
            assert len(mine["sharding_node"]) * len(mine["sharding_cross"]) == sdp
            assert all(r // rpn == rank // rpn for r in mine["sharding_node"])
            assert len({r // rpn for r in mine["sharding_cross"]}) == len(mine["sharding_cross"])


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        ((8, 3, 1, 8), r"tensor_parallel_degree=3 must divide world 8"),
        ((8, 2, 3, 8), r"sharded_data_parallel_degree=3 must divide the rdp degree 4"),
        ((8, 1, 1, 3), r"ranks_per_node=3 .* must divide the world size 8; use one of \[1, 2, 4, 8\]"),
        ((0, 1, 1, 1), r"world=0 must be >= 1"),
    ],
)
def test_bad_plans(args: tuple[int, int, int, int], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        plan(*args)


def test_unequal_node_split_disables_hierarchy() -> None:
    # world 6, sdp 3, 2 ranks a node: group (0,1,2) has 2 ranks on node 0 and 1 on node 1.
    p = plan(6, tp=1, sdp=3, ranks_per_node=2)
    assert p.groups_of(0)["sharding_node"] == () and p.sharding_node_groups == ()
