"""Whole-tensor reductions over sharded parameters, on their local pieces: each tensor's partial result
(a sum of powers, an extreme, a count) finished over the groups it is split over, one collective per
group for a whole list ([Note: sharded parameters], sharded_tensor.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from shardpar.collectives import Engine, Group, ReduceOp
from shardpar.runtime.shard_layout import ShardLayout


def reduce_scalars(values: list[torch.Tensor], layouts: list[ShardLayout], combine: str) -> list[torch.Tensor]:
    """Finish per-tensor partial results over the groups each tensor is split over, in one collective
    per group: `combine` is "sum" (partial sums) or "max"/"min" (partial extremes; an AllGather, as
    the engines reduce by SUM/AVG only)."""
    if not values:
        return []
    comm = layouts[0].comm
    if any(lay.comm is not comm for lay in layouts):
        raise TypeError("one reduction over parameters of two different DistributedModels")
    vec = torch.stack([v.float() for v in values])
    for group, member in ((comm.sharding, lambda lay: lay.sharded), (comm.tp, lambda lay: lay.tp is not None)):
        mask = torch.tensor([member(lay) for lay in layouts], device=vec.device)
        if group.size == 1 or not bool(mask.any()):
            continue
        vec = _reduce_over(comm.engine, group, vec, mask, combine)
    return [vec[i].to(values[i].dtype) for i in range(len(values))]


def _reduce_over(engine: Engine, group: Group, vec: torch.Tensor, mask: torch.Tensor, combine: str) -> torch.Tensor:
    if combine == "sum":
        part = torch.where(mask, vec, torch.zeros_like(vec))
        engine.all_reduce(part, group, op=ReduceOp.SUM)
        return torch.where(mask, part, vec)
    gathered = torch.empty(group.size * vec.numel(), dtype=vec.dtype, device=vec.device)
    engine.all_gather(gathered, vec.contiguous(), group)
    rows = gathered.view(group.size, -1)
    extreme = rows.amax(0) if combine == "max" else rows.amin(0)
    return torch.where(mask, extreme, vec)


def norm_parts(locals_: Sequence[torch.Tensor], ord: float) -> tuple[list[torch.Tensor], str]:
    """Per-tensor partial results of a vector norm of order `ord`, and how to combine them."""
    if ord == math.inf:
        return [t.abs().amax() if t.numel() else t.new_zeros(()) for t in locals_], "max"
    if ord == -math.inf:
        return [t.abs().amin() if t.numel() else t.new_full((), math.inf) for t in locals_], "min"
    if ord == 0:
        return [(t != 0).sum().to(t.dtype) for t in locals_], "sum"
    return [t.abs().pow(ord).sum() if t.numel() else t.new_zeros(()) for t in locals_], "sum"


def finish_norm(total: torch.Tensor, ord: float) -> torch.Tensor:
    return total if ord in (0, math.inf, -math.inf) else total.pow(1.0 / ord)
