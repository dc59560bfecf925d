"""save_checkpoint / resume_from_checkpoint: resharding, HF export, validation, pruning, crash safety."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardpar import checkpoint as ckpt
from tests.harness import RankFailure
from tests.multiproc import checkpoint_cases as cases

TOL = 1e-6


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_resume_under_other_topologies_matches_straight_run(ranks, tmp_path: Path) -> None:
    """6 steps straight == 3 steps, save on world 4 / sdp 2, resume on (2, 2), (4, 4), (1, 1), 3 more."""
    root = str(tmp_path)
    straight = ranks.run(4, cases.save_midway_case, root)[0]
    # one writer per shard: replica 0 of the sharding group (ranks 0, 1); replica 1 wrote nothing
    assert set(straight["files"]) == {
        "index.json",
        "rng.safetensors",
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    }
    # offline consolidation (what ZeRO-3 users convert by hand) gives the full model at step 3
    offline = dict(ckpt.load_consolidated(root))
    assert _max_diff(offline, straight["at_save"]) == 0.0
    for world, sdp in [(2, 2), (4, 4), (1, 1)]:
        label = f"world {world} / sdp {sdp}"
        for rank, res in enumerate(ranks.run(world, cases.resume_case, root, sdp)):
            assert res["sdp_size"] == sdp and res["step"] == 3
            assert _max_diff(res["resumed"], straight["at_save"]) == 0.0, f"{label} rank {rank}: params"
            assert _max_diff(res["moments"], straight["moments"]) == 0.0, f"{label} rank {rank}: Adam moments"
            losses = max(abs(a - b) for a, b in zip(res["losses"], straight["losses"], strict=True))
            assert losses <= TOL, f"{label} rank {rank}: losses differ by {losses:.2e}"
            assert _max_diff(res["final"], straight["final"]) <= TOL, f"{label} rank {rank}: final params"


@pytest.mark.parametrize(("name", "max_shard_size"), [("gpt2_tied", None), ("neox", 40_000)])
def test_full_export_loads_in_hugging_face(ranks, tmp_path: Path, name: str, max_shard_size: int | None) -> None:
    results = ranks.run(2, cases.hf_export_case, str(tmp_path), name, max_shard_size)
    r0 = results[0]
    assert r0["logits"] <= 1e-5, f"from_pretrained logits differ by {r0['logits']:.2e}"
    assert r0["info"]["missing_keys"] == [] and r0["info"]["unexpected_keys"] == [], r0["info"]
    assert r0["info"]["mismatched_keys"] == [], r0["info"]
    assert "config.json" in r0["files"] and "shardpar_full.json" in r0["files"]
    assert r0["bf16_dtypes"] == ["torch.bfloat16"], "smp.save_checkpoint(full_dtype=) must reach the export"
    if max_shard_size is None:
        assert "model.safetensors" in r0["files"]
    else:
        shards = [f for f in r0["files"] if f.startswith("model-")]
        assert len(shards) >= 2 and "model.safetensors.index.json" in r0["files"], r0["files"]
    for r in results:
        # streamed: one AllGather per unit, each exactly one unit's flat buffer
        assert r["gathers"] == [("all_gather", "sharding", b) for b in r["unit_bytes"]], r["gathers"]
        assert r["reload"] == 0.0 and r["content"] == {"m": name}
        assert r["partial_reload"] == 0.0 and r["moments"] == 0.0
        assert r["plain_reload"] == 0.0  # a save_pretrained directory resumes with partial=False too
        # a tied weight loads from whichever of its names the dict holds; a typo'd key is refused
        assert r["alias_dropped"] == (["transformer.wte.weight"] if name == "gpt2_tied" else []), r["alias_dropped"]
        assert r["alias_load"] == 0.0
        assert "unexpected keys ['transformer.h.0.mlp.c_fcc.weight']" in r["typo"], r["typo"]


def test_damaged_checkpoints_raise_clear_errors_and_load_nothing(ranks, tmp_path: Path) -> None:
    results = ranks.run(2, cases.errors_case, str(tmp_path))
    expected = {
        "truncated": ("shard-00001.safetensors", "truncated"),
        "missing": ("shard-00001.safetensors", "missing"),
        "foreign": ("shard-00001.safetensors", "another checkpoint"),
        "piece": ("index.json", "pieces cover 124 of 169 elements"),
        "index": ("index.json", "not valid JSON"),
        # 64 bytes of tensor data flipped, header untouched: one rank hashes it, every rank raises
        "corrupt": ("corrupt_partial/shard-00001.safetensors", "tensor 'param/", "checksum mismatch"),
        "corrupt_full": ("badfull/model.safetensors", "tensor 'blocks.", "checksum mismatch"),
        "nonexistent": ("nonexistent_partial", "missing"),
        "misfit": ("blocks.2", "not in the model"),
        "buffer": ("buffer marker: shape [4] in the model, [3] in the checkpoint",),
        "buffer_full": ("goodfull", "buffer marker: shape [4] in the model, [3] in the checkpoint"),
        "extra_buffer": ("good_partial", "buffer marker: in the checkpoint, not in the model"),
    }
    for rank, r in enumerate(results):  # every rank raises, also those that never read the bad file
        for tag, words in expected.items():
            message = r["errors"][tag]
            assert all(w in message for w in words), f"rank {rank} {tag}: {message}"
        assert r["unchanged"] == 0.0 and r["moments_unchanged"] == 0.0, "a failed resume changed the model"
        assert r["loose"] is None  # strict=False loaded what fits (no user_content was saved)
        assert r["loose_fit"] == 0.0 and len(r["loose_loaded"]) > 2, r["loose_loaded"]
        assert r["loose_skipped"] == [], r["loose_skipped"]  # the smaller model: everything fits
        assert r["loose_optimizer_empty"], "load_optimizer=False still loaded optimizer state"
        assert r["buffer_unchanged"], "a resume refused for a buffer's shape changed the model"


def test_keep_n_pruning_newest_pointer_and_argument_errors(ranks, tmp_path: Path) -> None:
    r = ranks.run(2, cases.keep_and_newest_case, str(tmp_path))[0]
    assert r["listing"] == ["newest", "t3_partial", "t4_partial"], r["listing"]
    assert r["newest"] == "t4"
    assert r["content"] == {"tag": "t4-again", "pair": (4, 2.5)}  # tuples survive the JSON round trip
    assert set(r["errors"]) == {"", "a/b", ".hidden", "newest", "content", "mid_window"}
    assert "inside an accumulation window: 1 of its 2 backward passes have run" in r["errors"]["mid_window"]
    assert "function" in r["errors"]["content"] and "no pickle" in r["errors"]["content"]
    assert r["listing_after"] == r["listing"], "failed saves left files behind"
    assert r["scaler"]["restored"] == r["scaler"]["saved"] and r["scaler"]["model"] == 512.0


def test_resume_starts_a_window_of_its_own_and_refuses_mid_window(ranks, tmp_path: Path) -> None:
    for r in ranks.run(2, cases.window_change_case, str(tmp_path)):
        assert r["replicas_differ"] == 0.0
        assert "full_dtype=torch.int8 must be a floating-point torch.dtype" in r["errors"]["full_dtype"]
        assert "resume_from_checkpoint inside an accumulation window: 1 of its 2" in r["errors"]["resume_mid_window"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["newest", "w_partial"]  # no int8 export


def test_sigkill_during_save_keeps_previous_checkpoint(ranks, tmp_path: Path) -> None:
    root = str(tmp_path)
    crash_env = {"SHARDPAR_TEST_POOL": "crash"}  # a pool of its own: the shared world-2 pool survives
    good = ranks.run(2, cases.crash_good_case, root, env=crash_env)
    with pytest.raises(RankFailure, match=r"rank 1 died with exit code -9\b"):  # SIGKILL, not another death
        ranks.run(2, cases.crash_during_save_case, root, env=crash_env, timeout=60)
    assert (tmp_path / "newest").read_text() == "good" and not (tmp_path / "bad_partial").exists()
    for rank, r in enumerate(ranks.run(2, cases.resume_after_crash_case, root)):
        assert r["content"] == {"tag": "good"}
        assert _max_diff(r["state"], good[rank]["state"]) == 0.0, "the previous checkpoint must resume exactly"
        assert torch.equal(r["rng"], good[rank]["rng"]), "RNG state restored (same world)"
        assert not any(n.startswith(".tmp-") for n in r["listing_after"]), r["listing_after"]
        assert "after_partial" in r["listing_after"]
    index = json.loads((tmp_path / "good_partial" / "index.json").read_text())
    assert index["topology"]["world"] == 2 and index["optimizer"]["class"] == "AdamW"


def test_sigkill_between_the_renames_of_a_resave_keeps_previous_checkpoint(ranks, tmp_path: Path) -> None:
    """Re-saving a tag renames the old directory aside, then the new one into place; rank 0 dies between."""
    root = str(tmp_path)
    crash_env = {"SHARDPAR_TEST_POOL": "crash"}
    good = ranks.run(2, cases.crash_good_case, root, env=crash_env)
    with pytest.raises(RankFailure, match=r"rank 0 died with exit code -9\b"):
        ranks.run(2, cases.crash_between_renames_case, root, env=crash_env, timeout=60)
    listing = sorted(p.name for p in tmp_path.iterdir())
    assert "good_partial" not in listing, f"the crash must hit the window between the renames: {listing}"
    # smp.resume_from_checkpoint puts the previous directory back, then loads it
    for rank, r in enumerate(ranks.run(2, cases.resume_after_crash_case, root, True)):
        assert r["content"] == {"tag": "good"}
        assert _max_diff(r["state"], good[rank]["state"]) == 0.0, "the previous checkpoint must resume exactly"
        assert torch.equal(r["rng"], good[rank]["rng"]), "RNG state restored (same world)"
        assert "good_partial" in r["listing_before"], r["listing_before"]
        # the resume itself removed the crashed re-save's temporary directory (its rank 0 is dead)
        assert not any(n.startswith((".old-", ".tmp-")) for n in r["listing_before"]), r["listing_before"]
        assert not any(n.startswith((".old-", ".tmp-")) for n in r["listing_after"]), r["listing_after"]


def test_loss_scaler_state_resumes_only_into_a_matching_fp16_scaler(ranks, tmp_path: Path) -> None:
    for rank, r in enumerate(ranks.run(2, cases.scaler_across_precisions_case, str(tmp_path))):
        saved, resumed = r["saved"], r["resumed"]
        for label, source in [("fp32_to_fp16", "fp32"), ("fp16_to_bf16", "fp16"), ("fp16_to_fp16", "fp16")]:
            res = resumed[label]
            assert _max_diff(res["state"], saved[source]["state"]) == 0.0, f"rank {rank} {label}: parameters"
            assert all(torch.isfinite(torch.tensor(res["losses"]))), f"rank {rank} {label}: {res['losses']}"
        # fp32 -> fp16 dynamic: nothing to carry over; the configured initial scale, one warning
        up = resumed["fp32_to_fp16"]
        assert up["scale"] == up["model_scale"] == 2.0**10 and up["scaler"]["cur_iter"] == 0, up["scaler"]
        assert len(up["warnings"]) == 1 and "saved in fp32" in up["warnings"][0], up["warnings"]
        # fp16 -> bf16: bf16 never scales its loss, whatever the fp16 run had reached
        down = resumed["fp16_to_bf16"]
        assert saved["fp16"]["scaler"]["loss_scale"] != 1.0
        assert down["scale"] == down["model_scale"] == 1.0 and down["scaler"]["kind"] == "static"
        assert len(down["warnings"]) == 1 and "bf16" in down["warnings"][0], down["warnings"]
        # fp16 -> fp16 with the same kind of scaler: restored exactly, silently
        same = resumed["fp16_to_fp16"]
        assert same["scaler"] == {**saved["fp16"]["scaler"]} and same["model_scale"] == same["scale"], same
        assert same["warnings"] == []
        assert "index.json" in r["malformed"] and "loss_scaler.cur_iter" in r["malformed"], r["malformed"]
        assert r["malformed_unchanged"] == 0.0, "a failed resume changed the model"


def test_an_export_that_fails_on_rank_0_raises_everywhere_at_once(ranks, tmp_path: Path) -> None:
    # The case's collective timeout is an hour: a rank left waiting for it would be reported hung here
    # (RankFailure after 300 s), so the run returning at all shows both ranks raised without waiting.
    for rank, r in enumerate(ranks.run(2, cases.export_fails_on_rank_0_case, str(tmp_path), timeout=300)):
        assert "test: the cast failed" in r["error"], (rank, r)
        assert not r["published"], (rank, r)
