"""cli/cross_node.py: what a layout sends across nodes per step (issue 28). The same arithmetic is
pinned against the engine's counts in tests/multiproc/test_cross_node.py."""

from __future__ import annotations

import pytest

from shardpar.cli.cross_node import Knobs, extra_state_bytes, link_seconds, traffic
from shardpar.cli.main import main
from shardpar.config import Config
from shardpar.topology import plan

UNITS = [4096 * 1024] * 8  # 8 blocks of 4M elements, no root, padded to every sdp here
P = sum(UNITS)


def test_node_local_layout_sends_only_the_replica_all_reduce() -> None:
    # 2 nodes x 8 ranks, sdp 8: each rank AllReduces its fp32 shard P/8 with its replica on the other node
    t = traffic(plan(16, 1, 8, 8), UNITS, Knobs(accum=4))
    assert (t.gather, t.reduce) == (0, 0)
    assert t.replica == 8 * (P / 8) * 4  # 2 replicas: a ring of two sends the whole shard once


def test_spanning_group_with_both_knobs_sends_what_the_node_local_layout_does() -> None:
    span = plan(16, 1, 16, 8)
    both = Knobs(accum=4, node_secondary_shard=True, defer_cross_node_reduce=True)
    t = traffic(span, UNITS, both)
    # one gather and one ReduceScatter of the model cross nodes per step: 8 ranks x P/16 x 4 bytes each
    assert t.gather == t.reduce == 8 * (P / 16) * 4
    assert t.total == traffic(plan(16, 1, 8, 8), UNITS, Knobs(accum=4)).total
    plain = traffic(span, UNITS, Knobs(accum=4))
    assert plain.gather == 4 * 2 * t.gather and plain.reduce == 4 * t.reduce  # fwd + bwd per micro-batch
    quantized = traffic(span, UNITS, Knobs(accum=4, node_secondary_shard=True, defer_cross_node_reduce=True,
                                           quantize_weights=True, quantize_gradients=True))  # fmt: skip
    assert quantized.total == pytest.approx(t.total / 4 * (1 + 4 / 256))


def test_flat_collectives_are_rings_and_gloo_reduce_scatter_is_an_all_reduce() -> None:
    span = plan(4, 1, 4, 2)  # a ring 0-1-2-3: one edge 1->2 leaves node 0
    t = traffic(span, [4000], Knobs(hierarchical_allgather=False, hierarchical_reduce_scatter=False))
    assert t.gather == 2 * 4000 * 3 / 4 * 4
    assert t.reduce == 2 * 4000 * 3 / 4 * 4


def test_memory_the_knobs_keep() -> None:
    span = plan(16, 1, 16, 8)
    extra = extra_state_bytes(span, P, Knobs(accum=4, compute_bytes=2, node_secondary_shard=True,
                                             defer_cross_node_reduce=True))  # fmt: skip
    assert extra == {
        "secondary shards (sdp_node_secondary_shard)": 2 * (P // 16) * 2,
        "deferred node sums (sdp_defer_cross_node_reduce)": 2 * (P // 16) * 4,
    }
    assert extra_state_bytes(plan(16, 1, 8, 8), P, Knobs(node_secondary_shard=True)) == {}  # nothing spans
    assert link_seconds(50e9, 400) == pytest.approx(1.0)


def test_estimate_prints_cross_node_bytes_and_the_node_local_alternative(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--model", "gpt-neox-20b", "--nodes", "2", "--sdp", "16", "--accum", "4"]
    assert main([*argv, "--link-gbps", "400"]) == 0
    out = capsys.readouterr().out
    assert "this layout, sdp 16" in out and "one node, sdp 8" in out
    assert "sdp = one node moves less across nodes" in out
    assert main([*argv, "--link-gbps", "400", "--node-secondary-shard", "--defer-cross-node-reduce"]) == 0
    out = capsys.readouterr().out
    assert "this layout moves no more" in out
    assert "deferred node sums (sdp_defer_cross_node_reduce)" in out.split("peak:")[1]  # in the memory estimate


@pytest.mark.parametrize(
    ("knob", "needs"),
    [
        ("sdp_node_secondary_shard", "sdp_hierarchical_allgather"),
        ("sdp_quantize_cross_node_gradients", "sdp_hierarchical_reduce_scatter"),
    ],
)
def test_a_cross_node_knob_without_its_hierarchical_collective_is_refused(knob: str, needs: str) -> None:
    with pytest.raises(ValueError, match=f"{knob}=True acts on the cross-node step of {needs}, which is False"):
        Config.from_any({knob: True, needs: False})
