"""shardpar's Trainer (`shardpar.integrations.transformers`) against transformers' own Trainer on one
process, same global batch: world 4, sdp 2, every parameter sharded, gradient accumulation 2,
max_grad_norm engaging; and tp 2 x sdp 2. Then checkpoints: stop after a save, resume_from_checkpoint=True at the same
and at another world size, and the saved Hugging Face weights through from_pretrained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.multiproc import trainer_cases as cases
from tests.multiproc import trainer_owner_cases

TOL = 1e-5
# bf16: shardpar computes with bf16 copies of the parameters (every op in bf16, fp32 main weights),
# transformers' bf16 autocasts the matmuls of fp32 parameters; each rounds to bf16 (2^-8 relative) in
# different places. The logged losses (token means) stay within BF16_LOSS_TOL of each other; the weights
# after 4 AdamW steps (lr 1e-2, which turns a rounding difference on a near-zero gradient into up to
# lr per step) are held to "as close to the fp32 run as transformers' own bf16 run is" (x BF16_SLACK).
BF16_LOSS_TOL = 1e-3
BF16_SLACK = 1.5


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _max_abs(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_trainer_matches_single_process_trainer(ranks, tmp_path: Path) -> None:
    ref = ranks.run(1, cases.reference_case, str(tmp_path / "ref"), timeout=600)[0]
    res = ranks.run(4, cases.parity_case, str(tmp_path / "sp"), timeout=900)[0]
    fp32, want = res["fp32"], ref["fp32"]
    assert (fp32["world"], fp32["sdp"], fp32["compute_dtype"]) == (4, 2, "torch.float32")
    assert len(fp32["loss"]) == cases.STEPS and fp32["learning_rate"] == want["learning_rate"]
    assert _max_abs(fp32["loss"], want["loss"]) <= TOL, (fp32["loss"], want["loss"])
    # max_grad_norm is shardpar's built-in clipping; the logged grad_norm is the norm it clipped by
    assert min(want["grad_norm"]) < 0.5 < max(want["grad_norm"]), want["grad_norm"]
    assert fp32["grad_norm"] == pytest.approx(want["grad_norm"], rel=TOL)
    assert _max_diff(fp32["final"], want["final"]) <= TOL
    # evaluate(): the loss averaged over the data-parallel ranks; predict(): logits in dataset order
    assert abs(fp32["eval"] - want["eval"]) <= TOL
    assert fp32["predictions"].shape == want["predictions"].shape
    assert (fp32["predictions"] - want["predictions"]).abs().max().item() <= TOL
    # accumulation 2 = backward_passes_per_step 2: the replication AllReduce only at the boundary (tp 2 x
    # sdp 2 on 4 ranks has one replica: no replication group to reduce over)
    for name in ("fp32", "bf16", "fp16", "checkpointing"):
        run = res[name]
        assert run["micro"] == [0] * cases.STEPS, f"{name}: replication AllReduce inside the window {run['micro']}"
        assert run["boundary"][0] > 0 and run["boundary"] == run["boundary"][:1] * cases.STEPS, run["boundary"]
    # gradient_checkpointing: the block is recomputed in backward, and training is unchanged
    recomputed = res["checkpointing"]
    assert recomputed["layer_calls"] == 2 * fp32["layer_calls"] == 2 * cases.STEPS * cases.ACCUM
    assert _max_abs(recomputed["loss"], want["loss"]) <= TOL
    assert _max_diff(recomputed["final"], want["final"]) <= TOL
    # tp 2 x sdp 2 (smp.init before the model, built under smp.tensor_parallelism()): the TP ranks read
    # one batch; the same losses, evaluation, predictions, and the full weights through save_model
    tp = res["tp"]
    assert (tp["world"], tp["tp"], tp["sdp"]) == (4, 2, 2)
    assert _max_abs(tp["loss"], want["loss"]) <= TOL and tp["grad_norm"] == pytest.approx(want["grad_norm"], rel=TOL)
    assert abs(tp["eval"] - want["eval"]) <= TOL and tp["predictions"].shape == want["predictions"].shape
    assert (tp["predictions"] - want["predictions"]).abs().max().item() <= TOL
    assert _max_diff(tp["final"], want["final"]) <= TOL
    bf16 = res["bf16"]
    assert bf16["compute_dtype"] == "torch.bfloat16"
    assert _max_abs(bf16["loss"], ref["bf16"]["loss"]) <= BF16_LOSS_TOL
    assert bf16["grad_norm"] == pytest.approx(ref["bf16"]["grad_norm"], rel=1e-2)  # Adam would hide a 2x gradient
    hf_bf16_drift = _max_diff(ref["bf16"]["final"], want["final"])
    assert 0 < _max_diff(bf16["final"], want["final"]) <= BF16_SLACK * hf_bf16_drift
    # fp16 (2^-11 relative) against fp32, with torch.amp.GradScaler's dynamic scale: no step skipped
    fp16 = res["fp16"]
    assert fp16["compute_dtype"] == "torch.float16"
    assert fp16["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-2), "a skipped step logs a non-finite norm"
    assert _max_abs(fp16["loss"], want["loss"]) <= BF16_LOSS_TOL
    assert 0 < _max_diff(fp16["final"], want["final"]) <= hf_bf16_drift


def test_optim_adafactor_trains_through_owner_compute_as_transformers_trainer_does(ranks, tmp_path: Path) -> None:
    """TrainingArguments(optim="adafactor"): transformers' Adafactor with the arguments transformers gives it,
    each sharded matrix stepped whole on one owner rank, world 4 / sdp 2 against one process."""
    want = ranks.run(1, trainer_owner_cases.reference_adafactor_case, str(tmp_path / "ref"), timeout=600)[0]
    per_rank = ranks.run(4, trainer_owner_cases.adafactor_case, str(tmp_path / "sp"), timeout=600)
    got = per_rank[0]
    assert got["optimizer"] == want["optimizer"] == "Adafactor", (got["optimizer"], want["optimizer"])
    assert got["sdp"] == 2 and got["planned"] > 0
    # each sharded parameter has one owner per sharding group (two groups: sdp 2 x 2 replicas)
    owned = sorted(f for r in per_rank for f in r["owned"])
    assert len(owned) == 2 * got["planned"] and len(set(owned)) == got["planned"], owned
    assert max(want["grad_norm"]) > 0.5, want["grad_norm"]  # max_grad_norm engages
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=TOL)
    assert got["learning_rate"] == want["learning_rate"]
    assert _max_abs(got["loss"], want["loss"]) <= TOL, (got["loss"], want["loss"])
    assert _max_diff(got["final"], want["final"]) <= TOL


def test_trainer_resumes_from_its_checkpoint_exactly_at_any_world_size(ranks, tmp_path: Path) -> None:
    first = ranks.run(4, cases.save_and_stop_case, str(tmp_path), timeout=900)[0]
    straight = first["straight"]
    assert len(straight["loss"]) == cases.RESUME_STEPS and first["stopped"]["loss"] == straight["loss"][:4]
    # save_total_limit=1 kept the newest checkpoint; it holds full HF weights, the shardpar partial
    # checkpoint and transformers' own files
    assert first["listing"] == ["checkpoint-4"], first["listing"]
    expected = {"config.json", "model.safetensors", "shardpar", "scheduler.pt", "trainer_state.json"}
    assert expected <= set(first["files"]) and "optimizer.pt" not in first["files"], first["files"]
    assert first["logits"] <= TOL, f"from_pretrained(checkpoint-4) logits differ by {first['logits']:.2e}"
    for world, directory in ((4, "b"), (2, "c")):
        res = ranks.run(world, cases.resume_case, str(tmp_path / directory), timeout=900)[0]
        assert res["world"] == world
        tail, want = res["resumed"]["loss"][4:], straight["loss"][4:]
        assert len(tail) == 2 and _max_abs(tail, want) <= TOL, f"world {world}: {tail} vs {want}"
        assert _max_diff(res["final"], first["straight_final"]) <= TOL, f"world {world}: final weights"
        assert res["saved"] <= TOL, f"world {world}: save_model -> from_pretrained differs by {res['saved']:.2e}"
        assert {"config.json", "model.safetensors", "training_args.bin"} <= set(res["final_files"])
