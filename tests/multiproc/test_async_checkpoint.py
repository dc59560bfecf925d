"""Async partial checkpoints (issue 32 item 1) and preemption (item 3): equal to synchronous saves,
training goes on while the writer is held, a failed write keeps `newest`, keep-N prunes, and a SIGTERM to
one rank saves on every rank and exits with PREEMPTED_EXIT_CODE; the restart resumes the same losses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardpar as smp
from shardpar.checkpoint.async_save import Staging
from tests.multiproc import async_ckpt_cases as cases

TOL = 1e-6


def test_async_save_writes_what_a_sync_save_writes_while_training_goes_on(ranks, tmp_path: Path) -> None:
    results = ranks.run(4, cases.async_equals_sync_case, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["started"] and r["steps_while_held"] == 3, (rank, r["steps_while_held"])
        assert not r["held_newest"] and not r["written_while_held"], "nothing is published before the commit"
        assert r["polled_while_held"] is False
        assert r["committed"] == str(tmp_path / "async" / "s_partial") and r["newest"] == "s"
        assert r["leftovers"] == [], r["leftovers"]
    r0 = results[0]
    sync_id, async_id = r0["sync_index"]["checkpoint_id"], r0["async_index"]["checkpoint_id"]
    assert r0["sync"].keys() == r0["async"].keys() == {
        "index.json", "rng.safetensors", "shard-00000.safetensors", "shard-00001.safetensors",
    }  # fmt: skip
    for name in ("rng.safetensors", "shard-00000.safetensors", "shard-00001.safetensors"):
        # byte-identical but for the checkpoint id every file carries (same length: hex uuid)
        assert r0["async"][name] == r0["sync"][name].replace(sync_id.encode(), async_id.encode()), name
    strip = {"checkpoint_id", "saved_at_ns", "files"}
    sync_index = {k: v for k, v in r0["sync_index"].items() if k not in strip}
    async_index = {k: v for k, v in r0["async_index"].items() if k not in strip}
    assert async_index == sync_index  # lr, step, loss scaler, pieces: as of the call, not of the commit
    for name, entry in r0["sync_index"]["files"].items():
        assert r0["async_index"]["files"][name] == entry, name  # sizes and checksums
    # staging holds exactly what each writer writes: ranks 0 and 1 (replica 0), nothing on replica 1
    shard_bytes = [len(r0["sync"][f"shard-0000{i}.safetensors"]) for i in (0, 1)]
    assert 0 < results[0]["staging_bytes"] < shard_bytes[0] and 0 < results[1]["staging_bytes"] < shard_bytes[1]
    assert results[2]["staging_bytes"] == results[3]["staging_bytes"] == 0


def test_failed_async_write_keeps_newest_and_keep_n_prunes(ranks, tmp_path: Path) -> None:
    for r in ranks.run(2, cases.async_failure_and_keep_case, str(tmp_path)):
        assert "failed on 1 of 2 ranks" in r["error"] and "rank 1: OSError: simulated: disk full" in r["error"]
        assert "rank 1: RuntimeError: simulated: no pinned memory left" in r["staging_error"], r["staging_error"]
        assert r["after_failure"]["newest"] == "a"
        assert r["after_failure"]["listing"] == ["a_partial", "newest"], r["after_failure"]["listing"]
        assert r["listing"] == ["k2_partial", "last_partial", "newest"], r["listing"]
        assert r["newest"] == "last" and r["content"] == {"step": 5}
        assert r["resumed_diff"] == 0.0


def test_sigterm_to_one_rank_saves_on_every_rank_and_the_restart_resumes(ranks, tmp_path: Path) -> None:
    straight = ranks.run(2, cases.preempted_case, str(tmp_path / "straight"), None, 6)
    preempted = ranks.run(2, cases.preempted_case, str(tmp_path / "run"), 1, 6)
    for r in preempted:
        assert r["code"] == smp.PREEMPTED_EXIT_CODE == 143 and r["stopped_after"] == 3, r
        assert r["lines"][0].startswith("shardpar: preempted (signal ") and "at step 3: saved " in r["lines"][0]
    assert "SIGTERM" in preempted[1]["lines"][0] and "on another rank" in preempted[0]["lines"][0]
    assert (tmp_path / "run" / "newest").read_text() == "step3"
    resumed = ranks.run(2, cases.preempted_case, str(tmp_path / "run"), None, 6)
    for s, p, r in zip(straight, preempted, resumed, strict=True):
        assert r["start"] == 3 and r["code"] is None
        both = p["losses"] + r["losses"]
        assert max(abs(a - b) for a, b in zip(both, s["losses"], strict=True)) <= TOL, (both, s["losses"])


def test_staging_copies_and_reuses_its_buffers() -> None:
    staging = Staging()
    src = {"a": torch.arange(6.0), "b": torch.ones(3, dtype=torch.float64)}
    first = staging.stage(src)
    ptrs = {k: v.data_ptr() for k, v in first.items()}
    src["a"].add_(100.0)  # training updates the original in place after the call returned
    assert first["a"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    second = staging.stage(src)
    assert all(second[k].data_ptr() == ptrs[k] for k in ptrs)  # the same layout: no new memory
    assert second["a"].tolist()[0] == 100.0 and staging.nbytes == 6 * 4 + 3 * 8
    staging.stage({"a": src["a"]})
    assert staging.nbytes == 6 * 4  # a key no longer written is not kept


@pytest.mark.slow  # three short recipe runs: about 90 s on the loaded 2-core machine
def test_recipe_saves_in_the_background_and_on_sigterm_then_resumes(ranks, tmp_path: Path) -> None:
    """recipes/causal_lm with --async-checkpoints: SIGTERM to rank 1 in step 3 saves step3 on both ranks and
    exits 143; --resume continues with the losses of an uninterrupted run."""
    from recipes.causal_lm.options import Options
    from recipes.causal_lm.report import read_metrics
    from recipes.causal_lm.train import run

    def opts(out: Path, **changes: object) -> Options:
        return Options(
            size="tiny", sdp=2, batch=2, seq=16, steps=5, lr=3e-3, warmup=1, out=str(out), export=False,
            sample_tokens=0, progress="lines", smp={"sdp_param_persistence_threshold": 1000},
            checkpoint_every=2, async_checkpoints=True, **changes,  # type: ignore[arg-type]
        )  # fmt: skip

    straight = ranks.run(2, run, opts(tmp_path / "a"))[0]
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == [
        "newest",
        "step4_partial",
        "step5_partial",
    ]  # fmt: skip  (keep 2, committed in the background and at the end)
    stopped = ranks.run(2, cases.recipe_preempted_case, opts(tmp_path / "b"), 1, 3)
    assert [r["code"] for r in stopped] == [143, 143] and [r["steps"] for r in stopped] == [3, 3]
    assert (tmp_path / "b" / "checkpoints" / "newest").read_text() == "step3"
    resumed = ranks.run(2, run, opts(tmp_path / "b", resume="newest"))[0]
    assert resumed.start_step == 3 and resumed.steps == [4, 5]
    losses = [r["loss"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")]
    assert len(losses) == 5
    assert max(abs(a - b) for a, b in zip(losses, straight.losses, strict=True)) <= 1e-6, (losses, straight.losses)


@pytest.mark.slow  # three short Trainer runs
def test_trainer_saves_on_sigterm_and_resumes(ranks, tmp_path: Path) -> None:
    for r in ranks.run(2, cases.trainer_preempted_case, str(tmp_path), timeout=600):
        assert r["code"] == smp.PREEMPTED_EXIT_CODE and r["listing"] == ["checkpoint-2"], r
        assert r["stopped"] == r["straight"][:2]
        tail = r["resumed"][-2:]
        assert len(tail) == 2 and max(abs(a - b) for a, b in zip(tail, r["straight"][2:], strict=True)) <= 1e-5, r
        assert r["restarted"] == r["resumed"], r  # a torchrun restart resumes as resume_from_checkpoint=True does
