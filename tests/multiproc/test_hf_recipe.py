"""recipes/hf_trainer/train.py on pool ranks: it trains (the loss falls), evaluates, checkpoints and
exports the full weights; a second run fine-tunes that export at another world size."""

from __future__ import annotations

import json
from pathlib import Path

from recipes.hf_trainer.train import main
from tests.multiproc.trainer_cases import fresh_accelerate_state


def _run(argv: list[str]) -> dict[str, float]:
    fresh_accelerate_state()
    return main(argv)


def test_recipe_fine_tunes_and_exports(ranks, tmp_path: Path) -> None:
    common = ["--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--seq", "32", "--logging_steps", "1"]
    first = tmp_path / "first"
    argv = [*common, "--output_dir", str(first), "--max_steps", "8", "--per_device_train_batch_size", "2"]
    argv += ["--gradient_accumulation_steps", "2", "--learning_rate", "3e-3", "--save_steps", "8", "--sdp", "2"]
    metrics = ranks.run(4, _run, argv, timeout=600)[0]
    assert 0 < metrics["eval_loss"] < 10 and metrics["eval_perplexity"] > 1, metrics
    state = json.loads((first / "checkpoint-8" / "trainer_state.json").read_text())
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in first.iterdir()}
    assert (first / "checkpoint-8" / "shardpar").is_dir()
    # fine-tune the export at world 2 (global batch 4 x 2 again): it starts where the first run ended
    second = tmp_path / "second"
    argv = [*common, "--output_dir", str(second), "--max_steps", "2", "--per_device_train_batch_size", "4"]
    argv += ["--model_name_or_path", str(first), "--learning_rate", "1e-3", "--save_strategy", "no", "--sdp", "2"]
    tuned = ranks.run(2, _run, argv, timeout=600)[0]
    assert abs(tuned["eval_loss"] - metrics["eval_loss"]) < 0.5, (tuned, metrics)
