"""Cases for test_hf_trainer_peft.py (issue 29 item 4): shardpar's Trainer on a PEFT LoRA model at world 2,
sdp 2, against PEFT's own save and load. Reuses trainer_cases.py's recipe (dataset, arguments)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

import shardpar as smp
from shardpar.integrations.transformers import Trainer
from tests import models
from tests.multiproc import trainer_cases as base

STEPS = 4
PROBE = models.lm_batch(7, 4)["input_ids"]


def lora_model(seed: int = 0) -> Any:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["query_key_value"], lora_dropout=0.0)
    return get_peft_model(models.tiny_neox(seed), lora)


def _trainer(out: str, world: int, callbacks: list[Any] | None = None, **changes: Any) -> Trainer:
    samples = STEPS * base.ACCUM * base.GLOBAL_BATCH
    return Trainer(
        model=lora_model(),
        args=base.training_args(out, world, max_steps=STEPS, **changes),
        train_dataset=base.TokenDataset(samples, 0),
        shardpar_config=base.SHARD,
        callbacks=callbacks,
    )


def _adapter(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The trained LoRA weights at full size (a collective)."""
    return {n: p.full_tensor() for n, p in trainer.model.named_parameters() if p.requires_grad}


def _logits(model: Any) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def _reload(directory: Path, logits: torch.Tensor) -> dict[str, Any]:
    """What PEFT's loaders and transformers' Auto class make of `directory` (rank 0)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    found: dict[str, Any] = {"files": sorted(p.name for p in directory.iterdir())}
    reloaded = PeftModel.from_pretrained(models.tiny_neox(0), directory)
    found["peft_logits"] = (_logits(reloaded) - logits).abs().max().item()
    try:
        AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
        found["auto"] = "loaded"
    except (OSError, ValueError) as e:  # no config.json: nothing that loads as a random model
        found["auto"] = type(e).__name__
    return found


def save_and_resume_case(out: str) -> dict[str, Any]:
    """(a) STEPS straight; (b) saving every 2 steps, stopped after the save at step 2; (c) resumed from
    (b)'s checkpoint to STEPS, then save_model. Rank 0 also saves an unwrapped PEFT model with PEFT's own
    save_pretrained: the file names a plain PEFT save (and transformers' Trainer) writes."""
    world = int(os.environ["WORLD_SIZE"])
    result: dict[str, Any] = {}
    straight = _trainer(f"{out}/a", world)
    straight.train()
    result["straight"] = _adapter(straight)
    smp.shutdown()

    stopped = _trainer(f"{out}/b", world, save_strategy="steps", save_steps=2, callbacks=[base.StopAfterSave(2)])
    stopped.train()
    logits = _logits(stopped.model)
    if smp.rank() == 0:
        result["checkpoint"] = _reload(Path(out) / "b" / "checkpoint-2", logits)
    smp.barrier()
    smp.shutdown()

    base.fresh_accelerate_state()
    resumed = _trainer(f"{out}/b", world, save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=True)
    result["resumed"] = _adapter(resumed)
    result["resumed_loss"] = base._history(resumed)["loss"]
    result["straight_loss"] = base._history(straight)["loss"]
    resumed.save_model(f"{out}/final")
    logits = _logits(resumed.model)
    # a checkpoint without shardpar/ (save_only_model) loads the adapter back: zero it, load final/
    with torch.no_grad():
        for p in resumed.model.parameters():
            if p.requires_grad:
                p.zero_()
    resumed._load_from_checkpoint(f"{out}/final")
    result["adapter_loaded"] = _adapter(resumed)
    if smp.rank() == 0:
        result["final"] = _reload(Path(out) / "final", logits)
        plain = Path(out) / "plain"
        lora_model().save_pretrained(plain)
        result["plain_files"] = sorted(p.name for p in plain.iterdir())
    smp.barrier()
    return result
