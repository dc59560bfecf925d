"""The whole value of a ShardedTensor (DTensor's `full_tensor()`): its pieces gathered over the groups it
is split over ([Note: sharded parameters], sharded_tensor.py). A collective: every rank of those groups
calls it for the same tensor, as with DTensor.

A rank's piece is a contiguous range of the flattened (TP-local) parameter and the ranges differ in
length from rank to rank, so the pieces are placed into a zero tensor of the whole size and summed over
the sharding group: the ranges are disjoint, so every element is its owner's value plus zeros, which
is exact in any floating dtype. A TP-split parameter is then AllGathered over the TP group and put
together in the Hugging Face layout (TPSplit.full_of)."""

from __future__ import annotations

import math

import torch

from shardpar.collectives import ReduceOp
from shardpar.runtime.shard_layout import ShardLayout


def full_value(local: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """A new tensor of `layout.shape` holding every rank's piece (`local` is this rank's)."""
    comm = layout.comm
    local = local.detach()
    if layout.sharded:
        flat = torch.zeros(math.prod(layout.local_shape), dtype=local.dtype, device=local.device)
        flat[layout.start : layout.start + layout.length] = local.reshape(-1)
        if comm.sharding.size > 1:
            comm.engine.all_reduce(flat, comm.sharding, op=ReduceOp.SUM)
        value = flat.view(layout.local_shape)
    else:
        value = local.clone().view(layout.local_shape)  # persistent: whole on every rank of the group
    if layout.tp is None or comm.tp.size == 1:
        return value
    out = torch.empty(comm.tp.size * value.numel(), dtype=value.dtype, device=value.device)
    comm.engine.all_gather(out, value.reshape(-1).contiguous(), comm.tp)
    return layout.tp.full_of(list(out.view(comm.tp.size, *layout.local_shape).unbind(0)))
