"""Done-when of issue 22: a GPT-2 script written the SageMaker model-parallel v1 way, modelled on AWS's
train_gpt_simple.py (recipes/smp_v1), runs on 2 CPU ranks with only its imports changed -- sdp 2, fp16
with clip_master_grads, 2 micro-batches, offloaded activation checkpoints, delayed parameter
initialisation, validation, partial checkpoints -- and a run resumed from its step-3 checkpoint repeats
the straight run's steps 4-6 exactly."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tests.multiproc import smp_v1_cases


def test_the_v1_script_trains_checkpoints_and_resumes_exactly(ranks, tmp_path: Path) -> None:
    data = tmp_path / "data"
    smp_v1_cases.write_data(data)
    straight = ranks.run(2, smp_v1_cases.run, smp_v1_cases.argv(data, tmp_path / "a"), timeout=300)
    first = straight[0]
    losses = first["loss"]
    assert len(losses) == 6 and len(first["val_loss"]) == 2, first
    assert losses[-1] < losses[0] - 0.05, losses  # fp16 steps were taken, not all skipped
    assert first["logits"].shape == (4, smp_v1_cases.SEQ, smp_v1_cases.VOCAB)  # the last step's 2 micro-batches
    for r in straight:  # every step's 2 layers per micro-batch went out and came back
        assert r["offloaded"] == (6 * 2 * 2, 6 * 2 * 2), r
        assert r["files"] == ["newest", "rank_0_record_0_0", "sharded_data_parallel_final_full_28544_partial"]
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == [
        "newest",
        "total_steps3_partial",
        "total_steps6_partial",
    ]

    # The first 3 steps again, then a fresh run that resumes from their checkpoint with --load_partial.
    ranks.run(2, smp_v1_cases.run, smp_v1_cases.argv(data, tmp_path / "b", max_steps=3), timeout=300)
    shutil.rmtree(tmp_path / "b" / "model")
    resumed = ranks.run(2, smp_v1_cases.run, smp_v1_cases.argv(data, tmp_path / "b", load_partial=1), timeout=300)[0]
    assert resumed["loss"] == losses[3:], (resumed["loss"], losses)
    assert resumed["val_loss"] == first["val_loss"][1:]
    assert torch.equal(resumed["logits"], first["logits"])
