"""Squared global gradient norm, every element counted once: the one rule for plain and
tensor-parallel models.

Inside a sharding group shards are disjoint (sum); persistent grads are replicated over the rdp
group (sharding position 0 adds them); replicas agree after the boundary AllReduce. Under tensor
parallelism:

    TP-split parameter:       each TP rank holds a different slice -> sum over the TP group
    TP-replicated parameter:  every TP rank holds the same values  -> count TP rank 0's only

So: one AllReduce over the sharding group -- of [all] without TP splits, of [split, replicated]
with them -- and, with them, one of (split + replicated on TP rank 0) over the TP group.

With shard_optimizer_state each rank holds its own piece of the shard's grads ([Note: replica-sharded
main], runtime/replica_shard.py): they are disjoint over the whole rdp group, so the AllReduce runs
over the rdp group instead (the same one float or two), and persistent grads are added by rdp rank 0.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shardpar.optim.sharded_state import OptimizerState
from shardpar.sharding.tp_split import TPSplit


def grad_norm_squared(state: OptimizerState, splits: Mapping[str, TPSplit] | None = None) -> torch.Tensor:
    """[1] tensor: the squared L2 norm of all (still loss-scaled) main grads of the full model.
    `splits`: the TP-split parameters by name (tp_split_table); empty or None without TP."""
    return reduce_grad_norm_squared(state, local_grad_norm_squared(state, splits), splits)


def local_grad_norm_squared(state: OptimizerState, splits: Mapping[str, TPSplit] | None = None) -> torch.Tensor:
    """This rank's share of the squared norm, before any collective: [all] without TP splits,
    [TP-split, TP-replicated] with them. Non-finite exactly when this rank's counted grads are."""
    coords = state.topology.coords
    first = coords.rdp_rank == 0 if state.replica_sharded else coords.sdp_rank == 0  # adds the replicated grads
    parts = torch.zeros(2 if splits else 1, dtype=torch.float32, device=state.device)
    for block in state.grad_blocks():
        if block.replicated and not first:
            continue
        if not splits:
            parts += block.grad.pow(2).sum()
            continue
        for piece in block.pieces:
            if piece.length:
                parts[0 if piece.fqn in splits else 1] += block.grad[piece.local].pow(2).sum()
    return parts


def reduce_grad_norm_squared(
    state: OptimizerState, parts: torch.Tensor, splits: Mapping[str, TPSplit] | None = None
) -> torch.Tensor:
    """[1]: the global squared norm from every rank's `local_grad_norm_squared` (reduced in place)."""
    topology = state.topology
    state.engine.all_reduce(parts, topology.rdp if state.replica_sharded else topology.sharding)
    if not splits:
        return parts
    total = parts[0:1] + (parts[1:2] if topology.coords.tp_rank == 0 else 0.0)
    state.engine.all_reduce(total, topology.tp)
    return total
