"""One conformance suite run against every engine, plus training parity through the smddp engine."""

from __future__ import annotations

import pytest

from shardpar.collectives import shm
from tests.multiproc.engine_conformance_cases import (
    check_engine,
    check_engine_agreement,
    check_hierarchical_progress_and_knob,
    check_smddp_across_nodes,
    check_sort_buffer_and_auto,
    parity_with_engine_stats,
)

SHM_OK, SHM_WHY = shm.available()
ENGINES = ["native", pytest.param("smddp", marks=pytest.mark.skipif(not SHM_OK, reason=SHM_WHY))]
SHARD = {"sdp_param_persistence_threshold": 10}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("engine", ENGINES)
def test_engine_conformance(ranks, engine: str, world: int) -> None:
    per_rank = ranks.run(world, check_engine, engine, timeout=300)
    for rank, problems in enumerate(per_rank):
        assert problems == [], f"rank {rank}: {problems}"


@pytest.mark.skipif(not SHM_OK, reason=SHM_WHY)
@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_smddp_across_simulated_nodes(ranks, ranks_per_node: int) -> None:
    """World 4 as 4 nodes of 1 or 2 nodes of 2: groups spanning 2, 3 and 4 nodes gather hierarchically
    (one-hop mesh between nodes, shm inside), bit-identical to the expected blocks."""
    per_rank = ranks.run(4, check_smddp_across_nodes, ranks_per_node, timeout=120)
    for rank, (problems, routes) in enumerate(per_rank):
        assert problems == [], f"rank {rank}: {problems}"
        assert routes.get(("all_gather", "hierarchical"), 0) > 0, routes
    # reductions across nodes are native (the transport is intra-node); with 2-rank nodes the group
    # (0, 1) lives on one node and goes through shm
    assert per_rank[0][1].get(("reduce_scatter", "native:spans_nodes"), 0) > 0, per_rank[0][1]
    if ranks_per_node == 2:
        assert per_rank[0][1].get(("all_reduce", "shm"), 0) > 0, per_rank[0][1]
        # (0, 2, 3) has 1 rank on node 0 and 2 on node 1: no even split, so a native gather
        assert per_rank[0][1].get(("all_gather", "native:uneven_nodes"), 0) > 0, per_rank[0][1]


@pytest.mark.skipif(not SHM_OK, reason=SHM_WHY)
def test_sort_buffer_rule_and_auto_engine(ranks) -> None:
    for res in ranks.run(4, check_sort_buffer_and_auto, timeout=120):
        assert res["exact"] == [True, True], res
        # 4 ranks x 4097 fp32 = 65552 bytes > 8 x 8192: sort fallback; 4 x 100 x 4 bytes: hierarchical
        assert res["routes"] == {("all_gather", "hierarchical"): 1, ("all_gather", "native:sort"): 1}, res
        assert res["auto"] == "SmddpEngine", res
        layout = {("broadcast", "native:layout"): 1, ("all_reduce", "native:layout"): 1}
        assert res["strided"] == (True, layout), res


@pytest.mark.skipif(not SHM_OK, reason=SHM_WHY)
def test_hierarchical_gather_progresses_without_wait_and_the_knob_turns_it_off(ranks) -> None:
    """Issue 18 items 4 and 2: the node step of an async hierarchical gather is chained on the
    cross-node step, so the output is complete before `wait`; the CountingEngine still records the two
    steps (issued at once, in order); sdp_hierarchical_allgather off routes the spanning gather natively."""
    for rank, res in enumerate(ranks.run(4, check_hierarchical_progress_and_knob, timeout=180)):
        for path, (completed, exact) in res["seen"].items():
            assert completed and exact, (rank, path, res["seen"])
        fp32 = 4
        assert res["records"] == [
            ("all_gather", "sharding_cross", 2 * 1001 * fp32),
            ("all_gather", "sharding_node", 4 * 1001 * fp32),
        ], (rank, res)
        # the smddp engine's own gather over (0,1,2,3), then the model path's cross step (one rank a
        # node: the mesh alone) and its node step (shm)
        assert res["routes_on"] == {("all_gather", "hierarchical"): 2, ("all_gather", "shm"): 1}, (rank, res)
        assert res["route_off"] == "native:hierarchical_off", (rank, res)
        assert res["exact_off"], (rank, res)
        assert res["routes_off"] == {("all_gather", "native:hierarchical_off"): 1}, (rank, res)


@pytest.mark.skipif(not SHM_OK, reason=SHM_WHY)
def test_ranks_agree_on_the_engine_and_nodes_stay_on_one_host(ranks) -> None:
    for rank, res in enumerate(ranks.run(2, check_engine_agreement, timeout=120)):
        assert res["picked"] == ["NativeEngine", "NativeEngine"], (rank, res)
        assert any("rank 1: test: no transport on this rank" in w for w in res["warnings"]), (rank, res)
        assert "ranks_per_node=2 puts ranks 0 and 1 on one node, but they run on different hosts" in res["spanning"]
        assert "set ranks_per_node (or LOCAL_WORLD_SIZE) to the number of ranks each host runs" in res["spanning"]
        assert res["disagree"].startswith("ranks_per_node is 2 on rank 0 but 1 on rank 1: set ranks_per_node"), res
        assert res["per_host"] == "SmddpEngine", (rank, res)


@pytest.mark.skipif(not SHM_OK, reason=SHM_WHY)
@pytest.mark.parametrize("sdp", [1, 2])
def test_training_parity_with_smddp(ranks, sdp: int) -> None:
    knobs = {**SHARD, "ddp_dist_backend": "smddp", "sharded_data_parallel_degree": sdp}
    result = ranks.run(2, parity_with_engine_stats, "mlp", knobs, timeout=300)[0]
    assert result["engine"] == "smddp"
    assert result["loss"] <= 1e-5 and result["param"] <= 1e-5, result
    assert result["fallbacks"] == {}, result["fallbacks"]
    shm_calls = sum(n for (op, route), n in result["routes"].items() if route == "shm")
    assert shm_calls > 0, result["routes"]


@pytest.mark.skipif(not SHM_OK, reason=SHM_WHY)
def test_small_scratch_buffer_falls_back_and_counts(ranks) -> None:
    knobs = {**SHARD, "ddp_dist_backend": "smddp", "sharded_data_parallel_degree": 2}
    env = {"SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES": "8192"}
    result = ranks.run(2, parity_with_engine_stats, "neox", knobs, env=env, timeout=300)[0]
    assert result["loss"] <= 1e-5 and result["param"] <= 1e-5, result
    assert result["fallbacks"].get(("all_gather", "scratch"), 0) > 0, result["fallbacks"]
    # every unit's shard is above 8 KiB: all gathers fell back, the reductions still went through shm
    assert result["routes"].get(("all_gather", "shm"), 0) == 0, result["routes"]
    assert result["routes"].get(("reduce_scatter", "shm"), 0) > 0, result["routes"]
    # and the per-step communication records show which calls fell back
    assert ("all_gather", "native-fallback") in result["recorded_engines"], result["recorded_engines"]
    assert ("reduce_scatter", "smddp") in result["recorded_engines"], result["recorded_engines"]
