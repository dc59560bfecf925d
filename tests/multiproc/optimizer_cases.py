"""Cases for test_optimizer.py, run on every rank of a pool (importable for spawn)."""

from __future__ import annotations

from typing import Any

import torch

import shardpar as smp
from tests import models
from tests.multiproc.parity import ADAM

SHARD = {"sdp_param_persistence_threshold": 10, "sharded_data_parallel_degree": 2}


def _everything(model: Any, opt: Any) -> list[torch.Tensor]:
    """Main shards, main grads and optimizer state: what a refused step must leave alone."""
    out = [u.main_shard.clone() for u in model.units] + [model.persistent.main.clone()]
    out += [u.main_grad.clone() for u in model.units if u.main_grad is not None]
    if model.persistent.main_grad is not None:
        out.append(model.persistent.main_grad.clone())
    for state in opt.state.values():
        out += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def step_mid_window_case() -> dict[str, Any]:
    """backward_passes_per_step=3: step() after 2 backward passes is refused before anything changes;
    after the 3rd it steps."""
    smp.init(SHARD)
    model = smp.DistributedModel(models.UnevenMLP(), backward_passes_per_step=3)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), **ADAM))
    rank, world = smp.rank(), smp.size()
    stats = smp.comm_stats()

    def backward(micro: int) -> None:
        batch = models.mlp_batch(micro, 2 * world)
        model.backward(model(**{k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}) / 3)

    for micro in range(3):  # one full window first, so there is optimizer state to protect
        backward(micro)
    opt.step()
    opt.zero_grad()
    for micro in range(2):
        backward(10 + micro)
    stats.begin_step()
    before = _everything(model, opt)
    try:
        opt.step()
        error = ""
    except ValueError as e:
        error = str(e)
    untouched = all(torch.equal(a, b) for a, b in zip(before, _everything(model, opt), strict=True))
    collectives = len(stats.begin_step())
    backward(12)
    opt.step()  # the window is complete now
    changed = not all(torch.equal(a, b) for a, b in zip(before, _everything(model, opt), strict=False))
    return {"error": error, "untouched": untouched, "collectives": collectives, "stepped_after": changed}


def step_mid_window_microbatches_case() -> dict[str, Any]:
    """microbatches=2, backward_passes_per_step=2: a window is two smp.step calls (4 backward passes).
    A step after one call is refused; the model knows the window although smp.step has returned.
    zero_grad abandons the half window, and the next window is counted from there."""
    smp.init({**SHARD, "sharded_data_parallel_degree": 1, "microbatches": 2})  # world 2: two replicas
    torch.manual_seed(0)
    model = smp.DistributedModel(models.UnevenMLP(), backward_passes_per_step=2)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    rank, world = smp.rank(), smp.size()

    @smp.step
    def train_step(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = model(**batch)
        model.backward(loss)
        return loss

    def call(seed: int) -> None:
        batch = models.mlp_batch(seed, 4 * world)
        train_step(model, {k: v[4 * rank : 4 * rank + 4] for k, v in batch.items()})

    call(0)
    try:
        opt.step()
        error = ""
    except ValueError as e:
        error = str(e)
    opt.zero_grad()  # abandon the half window: the next two calls are a whole one
    call(1)
    call(2)
    opt.step()
    flat = torch.cat([v.reshape(-1) for v in model.state_dict().values()])
    replicas = smp.allgather(flat)
    return {"error": error, "replicas_differ": max((t - replicas[0]).abs().max().item() for t in replicas)}
