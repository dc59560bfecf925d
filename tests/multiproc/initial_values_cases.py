"""Cases for test_initial_values.py (issue 29 item 2): ranks seeded apart start from rank 0's weights,
as with DDP ([Note: rank 0's initial values], runtime/initial_values.py). Run on every rank of a pool."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import shardpar as smp
from tests import models

# Powers of two: lr * grad and momentum * buf are exact, so an update rounds once whether the kernel
# fuses the multiply-add or not, and the flat pieces step bit for bit as DDP's tensors do.
SGD = {"lr": 0.25, "momentum": 0.5}


def _seed_of(rank: int) -> int:
    return 100 + 7 * rank  # every rank apart; rank 0's is 100


def _diff(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    if ours.keys() != theirs.keys():
        raise AssertionError(f"keys differ: {sorted(ours.keys() ^ theirs.keys())[:6]}")
    return max((ours[k].float() - theirs[k].float()).abs().max().item() for k in theirs)


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return models.UnevenMLP()


def ddp_case(threshold: int, *, steps: int = 3) -> dict[str, Any]:
    """World 2, sdp 2, every rank seeded apart. DDP broadcasts rank 0's weights when it wraps; so must
    smp.DistributedModel. Then both train on each rank's half of the batch: plain SGD (fp32, no clipping)."""
    smp.init(
        {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": threshold, "sdp_gradient_clipping": 0}
    )
    try:
        rank = smp.rank()
        model = smp.DistributedModel(_mlp(_seed_of(rank)))
        ref = DistributedDataParallel(_mlp(_seed_of(rank)))
        out: dict[str, Any] = {
            "at_wrap": _diff(model.state_dict(), ref.module.state_dict()),
            "rank0_model": _diff(model.state_dict(), _mlp(_seed_of(0)).state_dict()),
            "own_model": _diff(model.state_dict(), _mlp(_seed_of(rank)).state_dict()),
            "num_sharded": sum(len(u.params) for u in model.units),
            "num_whole": len(model.persistent.params),
        }
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), **SGD))
        ref_opt = torch.optim.SGD(ref.parameters(), **SGD)
        losses = 0.0
        for step in range(steps):
            batch = models.mlp_batch(step, 4)
            mine = {k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}
            loss = model(**mine)
            model.backward(loss)
            opt.step()
            opt.zero_grad()
            ref_loss = ref(**mine)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            losses = max(losses, abs(loss.item() - ref_loss.item()))
        out.update(loss=losses, param=_diff(model.state_dict(), ref.module.state_dict()))
        return out
    finally:
        smp.shutdown()


def delayed_case(same_seed: bool) -> dict[str, Any]:
    """World 2, sdp 2, delayed initialization: the wrapped model holds what one process seeded as rank 0
    builds normally. Ranks seeded alike replay their own records: no parameter is broadcast."""
    smp.init({"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 10})
    try:
        rank = smp.rank()
        seed = _seed_of(0 if same_seed else rank)
        with smp.delay_param_initialization():
            torch.manual_seed(seed)
            module = models.UnevenMLP()
        stats = smp.comm_stats()
        stats.begin_step()
        model = smp.DistributedModel(module)
        sent = [r for r in stats.begin_step() if r.op == "broadcast"]
        return {
            "rank0_model": _diff(model.state_dict(), _mlp(_seed_of(0)).state_dict()),
            "broadcasts": len(sent),
            "num_params": len(list(model.parameters())),
        }
    finally:
        smp.shutdown()


def tp_case(delayed: bool) -> dict[str, Any]:
    """World 4, tp 2, sdp 2, every rank seeded apart: the TP layers' slices and the replicated parameters
    are those of one model, rank 0's -- what one process seeded as rank 0 would build and split."""
    smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True, "sharded_data_parallel_degree": 2})
    try:
        rank = smp.rank()
        delay = smp.delay_param_initialization() if delayed else contextlib.nullcontext()
        with delay:
            module = models.tiny_neox(seed=_seed_of(rank))
        model = smp.DistributedModel(module, tensor_parallelism=True)
        full = model.state_dict()  # the Hugging Face layout, gathered over the sharding and TP groups
        return {"rank0_model": _diff(full, models.tiny_neox(seed=_seed_of(0)).state_dict())}
    finally:
        smp.shutdown()
