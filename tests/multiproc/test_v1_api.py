"""SageMaker model-parallel v1's rank/group queries, process-group handles and point-to-point object
helpers (issue 22, item 4) on 4 gloo ranks with tensor_parallel_degree 2."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc import v1_api_cases


def test_v1_ranks_and_process_groups(ranks) -> None:
    for r in ranks.run(4, v1_api_cases.groups_case):
        assert r["pp"] == (0, 1) and r["mp"] == r["tp"] and r["tp"][1] == 2
        assert r["ranks"] == r["expected"], r
        assert r["summed"] == {name: len(members) for name, members in r["expected"].items()}
        assert r["same_pp_handle"]
        assert r["lists"] == r["expected"] and r["barriers"] == "ok"


def test_v1_broadcast_send_and_recv_from(ranks) -> None:
    res = ranks.run(4, v1_api_cases.p2p_case)
    for rank, got in enumerate(res):
        if rank:
            assert got["world"]["from"] == 0 and torch.equal(got["world"]["t"], torch.arange(3))
        assert got["collective"] == "from 2"
    # TP groups are (0, 1) and (2, 3); tp rank 1 of each broadcast to its partner
    assert res[0]["tp"] == ("tp", 1) and res[2]["tp"] == ("tp", 3)
    assert "tp" not in res[1] and "tp" not in res[3]
    assert res[3]["ordered"] == ["first", "second"]


def test_v1_p2p_errors_name_the_rule_and_the_peer(ranks) -> None:
    res = ranks.run(4, v1_api_cases.p2p_errors_case)
    for errors in res:
        assert "is this rank itself" in errors["self"]
        assert "rank 5 is not a TP_RANK of this rank's group" in errors["range"] and "pass 0..1" in errors["range"]
        assert errors["type"].startswith("TypeError: smp.recv_from(src_rank=0, 'world'): rank_type must be")
    timeout = res[1]["timeout"]
    assert "global rank 2 sending" in timeout and "collective_timeout_s=3 s" in timeout, timeout
    assert res[1]["store_waits"] == [3.0], res[1]  # one wait, bounded by collective_timeout_s


def test_an_optimizer_of_a_tp_model_without_its_split_table_is_refused(ranks) -> None:
    for msg in ranks.run(4, v1_api_cases.optimizer_needs_tp_splits_case):
        assert "tensor_parallel_degree=2 needs its TP split table" in msg, msg


def test_every_member_broadcasting_without_src_is_an_error_not_a_hang(ranks) -> None:
    for msg in ranks.run(2, v1_api_cases.everyone_broadcasts_case):
        assert "pass src=<global rank>" in msg, msg


def test_the_sdp_templates_step_outputs_and_deepspeed_views(ranks) -> None:
    """Issue 30: a tuple return under @smp.step keeps its places across 2 micro-batches, and AWS's
    sdp_utils.py norms (per-rank partitions AllReduced over ds_param_shard_group) are each parameter's
    full norm, for sharded and persistent parameters alike, from the live fp32 buffers after a step."""
    for r in ranks.run(2, v1_api_cases.template_sdp_case):
        assert len(r["losses"]) == 2 and r["mean"] == pytest.approx(sum(r["losses"]) / 2)
        assert r["correct"][1] == torch.int64 and 0 <= r["correct"][0] <= 4 * 15
        assert r["persistent"] and r["grad_norm"] > 0
        for name, (from_buffer, from_ds_tensor) in r["norms"].items():
            assert from_buffer == pytest.approx(r["full"][name], rel=1e-5), name
            assert from_ds_tensor == pytest.approx(r["full"][name], rel=1e-5), name
