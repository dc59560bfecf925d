"""Cases for test_hf_accelerate.py: a user's own accelerate loop on shardpar's Accelerator at 4 ranks,
and the same loop in plain PyTorch in one process as the reference, on the same global batch.

The loop is accelerate's documented one: prepare, accumulate, backward, clip_grad_norm_ at the sync
step, step/scheduler/zero_grad, gather for the loss, gather_for_metrics for evaluation.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import GPTNeoXForCausalLM

import shardpar as smp
from shardpar.integrations.accelerate import Accelerator
from tests import models
from tests.multiproc.trainer_cases import ACCUM, EVAL, GLOBAL_BATCH, SHARD, TRAIN, TokenDataset, fresh_accelerate_state

STEPS = 4
MAX_NORM = 0.5
LR = 1e-2


def _schedule(step: int) -> float:
    return 1.0 / (1.0 + 0.1 * step)


def _optimizer(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6, weight_decay=0.1)  # eps: trainer_cases.py
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, _schedule)


def reference_case() -> dict[str, Any]:
    """One process, the whole global batch; accelerate steps the LR scheduler once per process per
    optimizer step (step_scheduler_with_optimizer), so the reference steps it `world` times."""
    world = 4
    model = models.tiny_neox(0)
    opt, sched = _optimizer(model)
    loader = DataLoader(TokenDataset(*TRAIN), batch_size=GLOBAL_BATCH, shuffle=False)
    losses, norms = [], []
    for i, batch in enumerate(loader):
        loss = model(**batch).loss
        (loss / ACCUM).backward()
        losses.append(loss.item())
        if (i + 1) % ACCUM == 0:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
            opt.step()
            for _ in range(world):
                sched.step()
            opt.zero_grad()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=TokenDataset(*EVAL).ids).logits
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "final": final, "eval_logits": logits}


def _prepare(accelerator: Accelerator) -> tuple[Any, Any, Any, Any]:
    world = int(os.environ["WORLD_SIZE"])
    model = models.tiny_neox(0)
    opt, sched = _optimizer(model)
    loader = DataLoader(TokenDataset(*TRAIN), batch_size=GLOBAL_BATCH // world, shuffle=False)
    prepared: tuple[Any, Any, Any, Any] = accelerator.prepare(model, opt, loader, sched)
    return prepared


def _train(accelerator: Accelerator, model: Any, opt: Any, loader: Any, sched: Any, steps: int) -> dict[str, Any]:
    """`steps` optimizer steps; per micro-step the loss (gathered mean) and the replication
    AllReduce calls of the open window so far (counting engine)."""
    losses, norms, replication = [], [], []
    stats = smp.comm_stats()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            replication.append(sum(1 for r in stats.current if r.op == "all_reduce" and r.group == "replication"))
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM).item())
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
        if len(norms) == steps and accelerator.sync_gradients:
            break
    return {"losses": losses, "norms": norms, "replication": replication}


def loop_case(out: str) -> dict[str, Any]:
    """World 4, sdp 2: the loop straight for STEPS steps (then evaluation through gather_for_metrics);
    and again stopped after 2 steps with save_state, rebuilt from scratch, load_state, 2 more steps."""
    fresh_accelerate_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM, shardpar_config=SHARD)
    model, opt, loader, sched = _prepare(accelerator)
    straight = _train(accelerator, model, opt, loader, sched, STEPS)
    straight["final"] = {k: v.clone() for k, v in model.state_dict().items()}
    straight["types"] = [type(model).__name__, type(opt.optimizer).__name__]
    straight["lr"] = sched.get_last_lr()
    world = int(os.environ["WORLD_SIZE"])
    evaluation = accelerator.prepare(
        DataLoader(TokenDataset(*EVAL), batch_size=GLOBAL_BATCH // world // 2, shuffle=False)
    )
    model.eval()
    gathered = []
    with torch.no_grad():
        for batch in evaluation:
            gathered.append(accelerator.gather_for_metrics(model(input_ids=batch["input_ids"]).logits))
    straight["eval_logits"] = torch.cat(gathered)
    accelerator.save_model(model, f"{out}/export")
    if smp.rank() == 0:
        exported = GPTNeoXForCausalLM.from_pretrained(f"{out}/export").state_dict()
        straight["export"] = max((exported[k] - v).abs().max().item() for k, v in straight["final"].items())
    smp.shutdown()

    fresh_accelerate_state()
    first = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM, shardpar_config=SHARD)
    model, opt, loader, sched = _prepare(first)
    head = _train(first, model, opt, loader, sched, 2)
    first.save_state(f"{out}/state")
    files = sorted(os.listdir(f"{out}/state"))
    smp.shutdown()

    fresh_accelerate_state()
    again = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM, shardpar_config=SHARD)
    model, opt, loader, sched = _prepare(again)
    again.load_state(f"{out}/state")
    tail = _train(again, model, opt, again.skip_first_batches(loader, 2 * ACCUM), sched, 2)
    resumed = {
        "losses": head["losses"] + tail["losses"],
        "norms": head["norms"] + tail["norms"],
        "final": {k: v.clone() for k, v in model.state_dict().items()},
        "lr": sched.get_last_lr(),
        "files": files,
    }
    smp.shutdown()

    # accelerate's mixed_precision becomes shardpar's: bf16 compute copies, and the loop still trains
    fresh_accelerate_state()
    bf16 = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=ACCUM, shardpar_config=SHARD)
    model, opt, loader, sched = _prepare(bf16)
    short = _train(bf16, model, opt, loader, sched, 1)
    mixed = {"compute": str(model.policy.compute), "config_bf16": smp.get_config().bf16, "losses": short["losses"]}
    return {"straight": straight, "resumed": resumed, "bf16": mixed}
