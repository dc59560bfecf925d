"""Issue 29 (1, 3): the clipping in force is the user's front end's, and `no_sync()` means what DDP's
does -- each loop against the same loop under DDP at world 2, fp32, bit for bit.

  * SMP API (sdp_gradient_clipping left at 1.0) with the FSDP2 port's own
    `torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)`: the user's clip replaces the built-in one
    (the first step's norm, ~1.5, would otherwise be clipped to 1.0), and returns torch's norm;
  * the same with accumulation through `model.no_sync()` and a clip that engages (0.5);
  * accelerate: a loop that never clips trains as DDP does; `accumulate()` with a plain `loss.backward()`
    and with `accelerator.backward`, clipping at the sync step; the replication AllReduce only there;
  * the Trainer clips by max_grad_norm (2.0), not by the knob's default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.multiproc import clip_sync_cases as cases


def _same_weights(run: dict[str, Any]) -> None:
    ddp, mine = run["ddp"]["final"], run["shardpar"]["final"]
    assert ddp.keys() == mine.keys()
    differ = [k for k in ddp if not bool((ddp[k] == mine[k]).all())]
    assert not differ, f"weights differ from DDP's in {differ}"


def test_smp_api_user_clip_replaces_the_built_in_one_and_no_sync_accumulates_as_ddp(ranks) -> None:
    # sdp 2, no accumulation, the FSDP2 port's clip at 2.0 (docs/migration.md)
    run = ranks.run(2, cases.smp_api_case, 2, 1, 2.0)[0]
    ddp, mine = run["ddp"], run["shardpar"]
    assert 1.0 < ddp["norms"][0] < 2.0, ddp["norms"]  # the built-in clip at 1.0 would have bitten
    assert mine["norms"] == ddp["norms"]  # torch's total norm, as one process computes it
    assert mine["clipped"] == [True] * cases.STEPS
    assert mine["clipping"].startswith("sdp_gradient_clipping=1.0: optimizer.step() clips"), mine["clipping"]
    _same_weights(run)
    # sdp 1 (two replicas), 2 micro-steps through model.no_sync(), a clip that engages
    run = ranks.run(2, cases.smp_api_case, 1, 2, 0.5)[0]
    ddp, mine = run["ddp"], run["shardpar"]
    assert max(ddp["norms"]) > 0.5 and mine["norms"] == ddp["norms"]
    assert mine["inside"] == [0] * cases.STEPS, "replication AllReduce inside no_sync()"
    assert mine["outside"] == [mine["outside"][0]] * cases.STEPS and mine["outside"][0] > 0, mine["outside"]
    _same_weights(run)


@pytest.mark.parametrize(
    ("sdp", "accum", "max_norm", "plain_backward"),
    [
        (2, 1, None, False),  # never clips: before issue 29 shardpar clipped at 1.0 anyway
        (1, 2, 0.5, True),  # accumulate() + loss.backward(): accelerate's no_sync(model) path
        (1, 2, 0.5, False),  # accumulate() + accelerator.backward
    ],
)
def test_accelerate_loop_clips_and_syncs_as_ddp(
    ranks, sdp: int, accum: int, max_norm: float | None, plain_backward: bool
) -> None:
    run = ranks.run(2, cases.accelerate_case, sdp, accum, max_norm, plain_backward)[0]
    ddp, mine = run["ddp"], run["shardpar"]
    assert mine["clipping"].startswith("accelerate's: only where the loop calls"), mine["clipping"]
    assert mine["norms"] == ddp["norms"]
    if max_norm is not None:
        assert max(ddp["norms"]) > max_norm, ddp["norms"]
    _same_weights(run)
    if sdp == 1:  # two replicas: their AllReduce in the backward at accelerate's sync step only
        per_sync = mine["replication"][accum - 1]
        assert per_sync > 0 and mine["replication"] == ([0] * (accum - 1) + [per_sync]) * cases.STEPS


def test_trainer_clips_by_max_grad_norm_only(ranks, tmp_path: Path) -> None:
    run = ranks.run(2, cases.trainer_case, str(tmp_path), 2.0)[0]
    ddp, mine = run["ddp"], run["shardpar"]
    assert 1.0 < ddp["grad_norm"][0] < 2.0, ddp["grad_norm"]  # sdp_gradient_clipping's 1.0 would have clipped
    assert mine["grad_norm"] == pytest.approx(ddp["grad_norm"], rel=1e-6)  # the built-in norm: summed per shard
    assert mine["clipping"].startswith("TrainingArguments.max_grad_norm=2.0"), mine["clipping"]
    _same_weights(run)
