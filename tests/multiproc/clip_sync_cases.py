"""Cases for test_clip_sync.py: whose clipping is in force, and DDP's no_sync, each against the same
loop under DDP (torch's DistributedDataParallel, or accelerate's own Accelerator, which wraps the model
in it) at the same world size, in the same pool, on the same per-rank batches.

Exact in fp32 where the arithmetic is the same: at sdp 2 without accumulation shardpar's ReduceScatter
averages the two ranks' gradients as DDP's AllReduce does; at sdp 1 gradients accumulate locally and are
AllReduced once per window, as under DDP's no_sync. (At sdp 2 with accumulation each micro-step is
ReduceScattered, which rounds differently: not used here.)
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from accelerate import Accelerator as DDPAccelerator
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import shardpar as smp
from shardpar.integrations.accelerate import Accelerator
from tests import models
from tests.multiproc.trainer_cases import TokenDataset, fresh_accelerate_state

STEPS = 3
PER_RANK = 4


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6, weight_decay=0.1)


def _batch(step: int, micro: int) -> dict[str, torch.Tensor]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    full = models.lm_batch(100 * step + micro, PER_RANK * world)
    return {k: v[rank * PER_RANK : (rank + 1) * PER_RANK] for k, v in full.items()}


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _replication_calls() -> int:
    return sum(1 for r in smp.comm_stats().current if r.op == "all_reduce" and r.group == "replication")


def _smp_loop(model: Any, opt: Any, *, accum: int, max_norm: float, plain_ddp: bool) -> dict[str, Any]:
    """The loop of docs/migration.md's FSDP2 port: accumulation through `model.no_sync()` (DDP's idiom),
    then `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` and a step."""
    norms, inside, outside, clipped = [], [], [], []
    for step in range(STEPS):
        for micro in range(accum):
            last = micro == accum - 1
            with model.no_sync() if not last else contextlib.nullcontext():
                model(**_batch(step, micro)).loss.div(accum).backward()
            if not plain_ddp:
                (outside if last else inside).append(_replication_calls())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        if not plain_ddp:
            clipped.append(opt.clipped_by_user)  # the user's clip takes over from the built-in one
        opt.step()
        opt.zero_grad()
    return {"norms": norms, "inside": inside, "outside": outside, "clipped": clipped}


def smp_api_case(sdp: int, accum: int, max_norm: float) -> dict[str, Any]:
    """DDP, then the SMP API (smp.init with sdp_gradient_clipping at its default 1.0, DistributedModel,
    DistributedOptimizer) running the same loop; the final weights of both."""
    ddp = DistributedDataParallel(models.tiny_neox(0))
    ref = _smp_loop(ddp, _adamw(ddp.parameters()), accum=accum, max_norm=max_norm, plain_ddp=True)
    ref["final"] = _state(ddp.module)

    smp.init({"sharded_data_parallel_degree": sdp, "sdp_param_persistence_threshold": 0})
    model = smp.DistributedModel(models.tiny_neox(0))
    opt = smp.DistributedOptimizer(_adamw(model.parameters()))
    clipping = str(opt.clipping)
    mine = _smp_loop(model, opt, accum=accum, max_norm=max_norm, plain_ddp=False)
    mine["final"] = _state(model)
    mine["clipping"] = clipping
    return {"ddp": ref, "shardpar": mine}


def _accelerate_loop(acc: Any, *, accum: int, max_norm: float | None, plain_backward: bool) -> dict[str, Any]:
    world = int(os.environ["WORLD_SIZE"])
    model = models.tiny_neox(0)
    loader = DataLoader(TokenDataset(PER_RANK * world * accum * STEPS, 0), batch_size=PER_RANK, shuffle=False)
    model, opt, loader = acc.prepare(model, _adamw(model.parameters()), loader)
    norms, replication = [], []
    stats = smp.comm_stats() if smp.is_initialized() else None
    for batch in loader:
        with acc.accumulate(model):
            loss = model(**batch).loss
            if plain_backward:  # accelerate's accumulate() docstring: loss.backward() inside it
                (loss / accum).backward()
            else:
                acc.backward(loss)
            if stats is not None:
                replication.append(sum(1 for r in stats.current if r.op == "all_reduce" and r.group == "replication"))
            if max_norm is not None and acc.sync_gradients:
                norms.append(acc.clip_grad_norm_(model.parameters(), max_norm).item())
            opt.step()
            opt.zero_grad()
    final = _state(acc.unwrap_model(model) if stats is None else model)
    out = {"norms": norms, "final": final, "replication": replication}
    if stats is not None:
        out["clipping"] = str(opt.optimizer.clipping)
    return out


def accelerate_case(sdp: int, accum: int, max_norm: float | None, plain_backward: bool) -> dict[str, Any]:
    """accelerate's Accelerator (DDP), then shardpar's, on the same loop."""
    fresh_accelerate_state()
    ddp = DDPAccelerator(cpu=True, gradient_accumulation_steps=accum)
    ref = _accelerate_loop(ddp, accum=accum, max_norm=max_norm, plain_backward=plain_backward)
    fresh_accelerate_state()
    config = {"sharded_data_parallel_degree": sdp, "sdp_param_persistence_threshold": 0}
    acc = Accelerator(cpu=True, gradient_accumulation_steps=accum, shardpar_config=config)
    mine = _accelerate_loop(acc, accum=accum, max_norm=max_norm, plain_backward=plain_backward)
    fresh_accelerate_state()
    return {"ddp": ref, "shardpar": mine}


def trainer_case(out: str, max_grad_norm: float) -> dict[str, Any]:
    """transformers' own Trainer (DDP), then shardpar's with the shardpar config's clipping knob left at
    its default: the Trainer clips by max_grad_norm only."""
    from transformers import Trainer as HFTrainer

    from shardpar.integrations.transformers import Trainer
    from tests.multiproc.trainer_cases import GLOBAL_BATCH, TRAIN, training_args

    world = int(os.environ["WORLD_SIZE"])
    runs: dict[str, Any] = {}
    for name, cls, extra in (
        ("ddp", HFTrainer, {}),
        ("shardpar", Trainer, {"shardpar_config": {"sharded_data_parallel_degree": 2}}),
    ):
        args = training_args(f"{out}/{name}", world, gradient_accumulation_steps=1, max_steps=STEPS)
        args.max_grad_norm = max_grad_norm
        trainer = cls(model=models.tiny_neox(0), args=args, train_dataset=TokenDataset(*TRAIN), **extra)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "grad_norm" in h]
        module = trainer.model.module if hasattr(trainer.model, "module") else trainer.model
        runs[name] = {"grad_norm": [h["grad_norm"] for h in logs], "final": _state(module)}
        if name == "shardpar":
            runs[name]["clipping"] = str(trainer.distributed_optimizer().clipping)
            smp.shutdown()
    assert GLOBAL_BATCH % world == 0
    return runs
