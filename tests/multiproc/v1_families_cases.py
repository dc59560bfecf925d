"""Cases for test_v1_families.py: the families of AWS's v1 templates (GPT-J, Flan-T5) driven the way
those templates drive them -- `smp.DistributedModel` / `smp.DistributedOptimizer`, an `@smp.step` that
returns a tuple, `smp.save_checkpoint(partial=True)` and `smp.resume_from_checkpoint` in a fresh run --
at tp 2 x sdp 2 and at sdp 2 x 2 replicas on 4 ranks (run on every rank of a pool)."""

from __future__ import annotations

from typing import Any

import torch

import shardpar as smp
from shardpar.api.data import rdp_slice
from tests import models, tp_families

FAMILIES = {"gptj": tp_families.gptj, "flan-t5": tp_families.t5_gated}
GLOBAL_BATCH = 4


@smp.step
def train_step(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    loss = model(**batch).loss
    model.backward(loss)
    return loss, (batch["labels"] >= 0).sum()  # v1: a StepOutput in each place of the returned tuple


def run(family: str, tp: int, sdp: int, root: str, steps: list[int], *, save_at: int = 0, resume: bool = False) -> Any:
    """Train `steps` (global step numbers: the batch follows the step), saving after step `save_at` or
    resuming first; each step's (mean loss, tokens summed over micro-batches)."""
    smp.init(
        {
            "tensor_parallel_degree": tp,
            "sharded_data_parallel_degree": sdp,
            "sdp_param_persistence_threshold": 40,
            "prescaled_batch": tp > 1,  # the templates' tp setting: every TP rank reads the same rows
        }
    )
    model = smp.DistributedModel(FAMILIES[family](0), tensor_parallelism=tp > 1)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01))
    if resume:
        content = smp.resume_from_checkpoint(root, partial=True)
        assert content == {"step": steps[0]}, content
    out = []
    for step in steps:
        batch = rdp_slice(models.lm_batch(1000 + step, GLOBAL_BATCH, vocab=tp_families.VOCAB))
        opt.zero_grad()
        loss_mb, tokens_mb = train_step(model, batch)
        opt.step()
        out.append((loss_mb.reduce_mean().item(), int(tokens_mb.reduce_sum().item())))
        if step + 1 == save_at:
            smp.save_checkpoint(root, f"step{save_at}", partial=True, model=model, optimizer=opt,
                                user_content={"step": save_at})  # fmt: skip
    return out
