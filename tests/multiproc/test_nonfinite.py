"""A NaN/inf loss or gradient on one rank or on all (fp32, bf16) skips the step on every rank with the
state bit-identical, training goes on, and sdp_max_nonfinite_steps consecutive skips end in an error
naming the knob; fp16 keeps its loss-scaler rule (issue 24 item 1)."""

from __future__ import annotations

import pytest

from tests.multiproc import nonfinite_cases as cases

LOSS_RANKS = {"loss_one": [1], "grad_one": [], "data_one": [3], "loss_all": [0, 1, 2, 3]}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("inject", sorted(LOSS_RANKS))
def test_a_non_finite_step_is_skipped_everywhere_then_raises_after_the_limit(
    ranks, precision: str, inject: str
) -> None:
    results = ranks.run(4, cases.nonfinite_case, precision, inject, 1)
    for rank, r in enumerate(results):
        where = f"rank {rank} ({precision}, {inject})"
        assert r["first_error"] == "" and r["skipped"], f"{where}: {r['first_error']}"
        assert r["untouched"], f"{where}: the skipped step changed weights or optimizer state"
        assert r["stepped_after"] and r["finite"], f"{where}: training did not go on after the skip"
        if precision == "fp32":  # against one process that never saw the poisoned batch
            assert r["param_diff"] <= 1e-5, f"{where}: {r['param_diff']}"
        # limit 1: the first poisoned step of the run is skipped, the second raises, on every rank
        assert [step for step, _ in r["errors"]] == [4], f"{where}: {r['errors']}"
        message = r["errors"][0][1]
        assert "at 2 consecutive optimizer steps (steps 4-5), more than sdp_max_nonfinite_steps=1" in message, message
        assert f"non-finite loss in model.backward on ranks {LOSS_RANKS[inject]}" in message or (
            not LOSS_RANKS[inject] and "on no rank" in message
        ), message
        assert r["untouched_at_error"], f"{where}: a skipped step or the one that raised changed state"
        if rank != 0:
            assert r["logs"] == [], f"{where}: only rank 0 logs"
    logs = results[0]["logs"]
    assert len(logs) == 2 and "optimizer step 2 skipped on every rank" in logs[0], logs
    expected = f"ranks {LOSS_RANKS[inject]}" if LOSS_RANKS[inject] else "no rank"
    assert f"non-finite loss in model.backward on {expected}" in logs[0], logs


def test_limit_zero_raises_at_once_on_every_rank(ranks) -> None:
    for rank, r in enumerate(ranks.run(4, cases.nonfinite_case, "bf16", "grad_one", 0)):
        message = r["first_error"]
        assert "at 1 consecutive optimizer steps (step 2), more than sdp_max_nonfinite_steps=0" in message, (
            f"rank {rank}: {message}"
        )
        assert r["untouched"] and r["stepped_after"], f"rank {rank}: {r}"
        assert [step for step, _ in r["errors"]] == [3], f"rank {rank}: the next poisoned step raises at once too"
        assert r["logs"] == [], "nothing was skipped, so nothing is logged"


def test_fp16_keeps_the_loss_scalers_rule(ranks) -> None:
    for rank, r in enumerate(ranks.run(4, cases.nonfinite_case, "fp16", "loss_one", 1)):
        assert r["first_error"] == "" and r["skipped"] and r["untouched"] and r["stepped_after"], f"rank {rank}: {r}"
        assert r["errors"] == [], f"rank {rank}: fp16 overflow has no limit: {r['errors']}"
        assert r["logs"] == [], "fp16 overflows are the scaler's business, not the non-finite guard's"


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_a_healthy_step_gains_at_most_the_norms_one_float_allreduce(ranks, clip: float) -> None:
    step = ranks.run(4, cases.count_step_collectives_case, clip)[0]["step"]
    assert step == [("all_reduce", "sharding", 4)], step
