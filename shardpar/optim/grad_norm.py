"""Squared global gradient norm of a tensor-parallel model, every element counted once.

    TP-split parameter:       each TP rank holds a different slice -> sum over the TP group
    TP-replicated parameter:  every TP rank holds the same values  -> count TP rank 0's only

Inside a sharding group shards are disjoint (sum); persistent grads are replicated over the rdp
group (sharding position 0 adds them); replicas agree after the boundary AllReduce. So: one
AllReduce of [split, replicated] over the sharding group, then one of (split + replicated on TP
rank 0) over the TP group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from shardpar.tensor_parallel.split import TPSplit

if TYPE_CHECKING:
    from shardpar.runtime.model import DistributedModel


def tp_grad_norm_squared(model: DistributedModel, splits: Mapping[str, TPSplit]) -> torch.Tensor:
    """[1] tensor: the squared L2 norm of all (still loss-scaled) main grads of the full model."""
    parts = torch.zeros(2, dtype=torch.float32, device=model.device)  # [TP-split, TP-replicated]
    for unit in model.units:
        if unit.main_grad is None:
            continue
        for sl in unit.slices:
            if sl.length:
                parts[0 if sl.spec.fqn in splits else 1] += unit.main_grad[sl.local].pow(2).sum()
    persistent = model.persistent
    if persistent.main_grad is not None and model.topology.coords.sdp_rank == 0:
        for i, (name, _) in enumerate(persistent.named):
            grad = persistent.grad_view(i)
            if grad is not None:
                parts[0 if name in splits else 1] += grad.pow(2).sum()
    model.engine.all_reduce(parts, model.topology.sharding)
    total = parts[0:1] + (parts[1:2] if model.topology.coords.tp_rank == 0 else 0.0)
    model.engine.all_reduce(total, model.topology.tp)
    return total
