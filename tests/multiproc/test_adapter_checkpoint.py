"""Issue 33 item 3: a partial checkpoint of a model with frozen parameters stores what trains (+ its
optimizer state) and a fingerprint of the frozen base; it resumes bit for bit at another sdp, refuses a
different base, and the wrapped PEFT model's `save_pretrained` writes PEFT's adapter format."""

from __future__ import annotations

from pathlib import Path

from tests.multiproc import adapter_ckpt_cases as cases
from tests.multiproc.adapter_ckpt_cases import CHANGED

INDEX_ALLOWANCE = 64 << 10  # index.json, rng.safetensors and the safetensors headers: fixed, not per weight


def test_adapter_only_checkpoint_resumes_at_another_sdp_and_refuses_another_base(ranks, tmp_path: Path) -> None:
    results = ranks.run(2, cases.adapter_checkpoint_case, str(tmp_path), 2, 1, timeout=300)
    r0 = results[0]
    adapter_and_adam = 3 * r0["trainable_bytes"]  # fp32 values, exp_avg, exp_avg_sq
    files = r0["files"]
    total = sum(files.values())
    # only what trains: the bf16 base (several MiB) would not fit in the allowance
    assert total <= 1.05 * adapter_and_adam + INDEX_ALLOWANCE, (total, adapter_and_adam, files)
    assert r0["frozen_bytes"] > 10 * INDEX_ALLOWANCE, r0["frozen_bytes"]
    index = r0["index"]
    assert index["version"] == 3 and len(index["frozen"]) == r0["num_frozen"], index.get("frozen")
    assert all("lora_" in fqn for fqn in index["params"]), sorted(index["params"])[:4]
    assert all(len(e["checksums"]) == 1 for e in index["frozen"].values())
    for r in results:
        sharded, frozen_big, nothing_sharded = r["summary"]  # the wrap summary counts the sharded frozen base
        assert sharded == frozen_big > 0 and not nothing_sharded, r["summary"]
        # resumed at sdp 1 (2 replicas) from sdp 2: every weight (the base from the user's model, the
        # adapters from the checkpoint) and the Adam state equal bit for bit, and so is the next step
        assert r["optimizer_tensors"] > 0 and r["resume_diff"] == 0.0, r["resume_diff"]
        assert r["resumed_loss"] == r["straight_loss"] and r["step_diff"] == 0.0, r
        # a changed base: the same clear error on every rank, naming the tensor and the fix; nothing loaded
        refused = r["refused"]
        assert refused is not None and cases.CHANGED in refused and "same base weights" in refused, refused
        assert "partial=False" in refused and r["untouched"], refused
        # save_pretrained (at sdp 2) gathered at most the adapters (persistent here: nothing), never the
        # sharded frozen base (a full state dict gathers its 4 MiB embedding alone)
        assert 0 <= r["save_pretrained_gathered"] <= r["trainable_bytes"], r["save_pretrained_gathered"]
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(r0["peft_files"]), r0["peft_files"]
    assert r0["peft_diff"] == 0.0, r0["peft_diff"]
    assert "adapter-only" in r0["convert_refused"] and "partial=False" in r0["convert_refused"], r0["convert_refused"]


def test_adapter_save_reuses_the_base_fingerprint_until_the_base_is_written(ranks, tmp_path: Path) -> None:
    """[Note: fingerprint cache]: the wrap hashes the frozen base (sdp 2: each rank its shard); saves after
    training steps hash nothing again and record what a fresh hash records; a write into the base after
    wrap (load_state_dict) is hashed again at the next save, and so is a write through a user parameter's
    `.data`, which moves no version counter; a resume never reuses a hash."""
    from tests.multiproc import fingerprint_cache_cases

    for r in ranks.run(2, fingerprint_cache_cases.fingerprint_cache_case, str(tmp_path), timeout=300):
        assert r["at_wrap"] == r["frozen_numel"], r  # every frozen element hashed once, by one rank
        (reused, saved), (fresh, saved_fresh) = r["reused"], r["fresh"]
        assert reused == 0 and fresh == r["frozen_numel"], (reused, fresh)
        assert saved == saved_fresh and len(saved) > 10, saved
        (rehashed, written), (_, written_fresh) = r["written"], r["written_fresh"]
        assert rehashed > 0, rehashed  # hashed again (every frozen piece: a load moves ShardedState.writes)
        assert written == written_fresh and written[CHANGED] != saved[CHANGED], written[CHANGED]
        assert {f for f in saved if written[f] != saved[f]} == {CHANGED}
        (rehashed, user), (_, user_fresh) = r["user_write"], r["user_write_fresh"]
        assert rehashed > 0 and user == user_fresh, rehashed  # p.data.add_() moves no version counter
        assert {f for f in user if user[f] != written[f]} == {fingerprint_cache_cases.OTHER}
        assert r["resume"] == "ok", r["resume"]
        assert "2 of " in r["resume_old"] and "same base weights" in r["resume_old"], r["resume_old"]
