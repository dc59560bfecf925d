"""Cases for test_smp_v1_recipe.py: recipes/smp_v1/train_gpt_simple.py's main() on every rank."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import torch

import shardpar as smp
from recipes.smp_v1 import train_gpt_simple
from shardpar.api import context

SEQ, VOCAB = 32, 64


def write_data(directory: Path, files: int = 2, samples: int = 32) -> None:
    """JSON-lines files of arithmetic token sequences (learnable: the loss falls within a few steps)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for f in range(files):
        with open(directory / f"train_{f}.json", "w") as out:
            for _ in range(samples):
                start, stride = rng.randrange(VOCAB), rng.randrange(1, 5)
                ids = [(start + stride * k) % VOCAB for k in range(SEQ)]
                out.write(json.dumps({"input_ids": ids, "attention_mask": [1] * SEQ}) + "\n")


def argv(data: Path, out: Path, **options: Any) -> list[str]:
    """The script's command line: a 2-layer GPT-2, no dropout (a resumed run must repeat the same
    steps), fp16 from loss scale 256, 2 micro-batches, offloaded activation checkpoints, delayed
    parameter initialisation, validation and a partial checkpoint every 3 steps; the learning rate
    decays over 6 steps whatever --max_steps says, so a 3-step run is the first half of a 6-step one."""
    base = {
        "training-dir": data, "test-dir": data, "zipped_data": 0, "checkpoint-dir": out / "checkpoints",
        "model-dir": out / "model", "sharded_data_parallel_degree": 2, "max_steps": 6, "lr": 3e-3,
        "warmup": 0.0, "lr_decay_iters": 6, "num_layers": 2, "hidden_width": 32, "num_heads": 4, "vocab_size": VOCAB,
        "max_context_width": SEQ, "train_batch_size": 4, "val_batch_size": 2, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0, "fp16": 1, "init_loss_scale": 256, "microbatches": 2,
        "offload_activations": 1, "activation_loading_horizon": 1, "delayed_param": 1, "checkpoint_freq": 3,
        "validation_freq": 3, "validation_batches": 1, "logits_output": "record", "logging_freq": 100,
        "save_final_full_model": 1,
        **options,
    }  # fmt: skip
    return [item for key, value in base.items() for item in (f"--{key}", str(value))]


def run(args: list[str]) -> dict[str, Any]:
    """main() on this rank; rank 0 returns the losses and logits the script saved with smp.save, and
    the offloader's counts, read before the harness shuts smp down."""
    train_gpt_simple.main(args)
    result: dict[str, Any] = {"rank": smp.rank()}
    offloader = context.activation_offloader()
    if offloader is not None:
        result["offloaded"] = (offloader.stats.num_offloaded, offloader.stats.num_reloaded)
    model_dir = args[args.index("--model-dir") + 1]
    if smp.rank() == 0:
        record = smp.load(os.path.join(model_dir, "rank_0_record"), partial=True)
        result.update(loss=record["loss"], val_loss=record["val_loss"], logits=record["logits"])
    result["files"] = sorted(p.name for p in Path(model_dir).iterdir())
    torch.distributed.barrier()
    return result
