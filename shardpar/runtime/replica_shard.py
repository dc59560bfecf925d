"""shard_optimizer_state: the main values, main grads and optimizer state of a unit's shard split once
more, over the replication group (`ReplicaShard`, one per unit).

[Note: replica-sharded main]
MiCS keeps the sharded model state once per sharding group: every replica holds the same fp32 main
shard, main grad and optimizer state (reference 003: 48 copies at 1536 GPUs, sdp 32). With
`shard_optimizer_state` each rank of a replication group owns one equal piece of the shard it shares
with them -- replica j the j-th -- so each rank owns 1/(sdp x replicas) of the fp32 state:

    unit, flat, sdp 2 x 2 replicas:  | shard 0           | shard 1           |   (layout aligned: shard % 2 == 0)
    rank (sdp 0, replica 0) owns     | piece 0 |         |         |         |
    rank (sdp 0, replica 1) owns     |         | piece 1 |         |         |
    rank (sdp 1, replica 0) owns     |         |         | piece 2 |         |   piece = sdp_rank x replicas + replica
                                                                                (sharding/layout.py `owned_layout`)

A step, for one unit (w = shard elements, R = replicas; bytes are the counting engine's):

    backward, every micro-step  ReduceScatter (sharding group) -> the shard's main grad [w], summed
                                over the window exactly as without the knob (unit.main_grad)
    accumulation boundary       ReduceScatter AVG (replication group) of that main grad -> this rank's
                                piece [w/R] (`finish_accumulation`); the [w] main grad is dropped.
                                It replaces the AllReduce AVG of the same [w] tensor: the same bytes
                                in, half the wire traffic (an AllReduce is a ReduceScatter + AllGather)
    optimizer.step              grad norm over the rdp group (the pieces are disjoint there; the
                                optim/grad_norm.py rule), clip, then the optimizer steps the owned
                                piece only: its leaves alias `main` (runtime/state.py Piece)
    after the step              AllGather (replication group) of the updated piece, cast to the compute
                                dtype first, into the compute shard (`refresh`): the AllGather the
                                AllReduce would have done, carrying parameters instead of gradients

So replication traffic per step is today's AllReduce bytes as one ReduceScatter plus one AllGather
(the AllGather in the compute dtype: half of it under bf16/fp16), and nothing more. At sdp 1 the unit's
shard is the whole unit -- ZeRO-2 (parameters replicated, gradients and optimizer state partitioned)
-- and the bucket that carries the replication AllReduce in a boundary backward ([Note: replication in
the bucket], reducer.py) carries this ReduceScatter instead: it is packed [R, width / R], row j holding
piece j of every unit, and each unit first folds in the earlier micro-steps' main grad (`fold`).

What stays per rank: the compute shard [w] in the compute dtype (the sharding group AllGathers it);
the fp32 piece [w/R] (in fp32 a view of the compute shard, which then *is* the main shard: nothing is
copied); its main grad [w/R] once the boundary passed; the optimizer state of [w/R]. Inside an
accumulation window the shard's main grad is still [w] (the window sums there; a ReduceScatter per
micro-step would cost R-1/R of a shard's traffic each time), and it is [w] at the end of each
boundary backward until its ReduceScatter: the knob shrinks what lives across steps, not the
gradient working set of a backward.

Persistent parameters stay whole on every rank (too small to shard; their rdp AllReduce carries the
unused-parameter flags). Checkpoints: every replica writes its pieces (checkpoint/partial.py), so
each element is still stored once, and a resume reads its own ranges whatever wrote them. A full
fp32 value under bf16/fp16 exists on no rank, so `main_shard_values` AllGathers the pieces over the
replication group first: a full export then runs on every replica, not only on replica 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from shardpar.collectives import Engine, Group, ReduceOp
from shardpar.precision import DtypePolicy
from shardpar.runtime.unit_comm import UnitComm
from shardpar.sharding.layout import FlatLayout, ParamSlice, owned_layout
from shardpar.topology import Topology


@dataclass(frozen=True)
class ReplicaComm:
    """The replication group a unit's shard is split over, and this rank's place in it."""

    engine: Engine
    replication: Group
    index: int  # this rank's position in its replication group: its replica

    @property
    def size(self) -> int:
        return self.replication.size

    @property
    def align(self) -> int:
        """What each unit's shard length is padded to a multiple of: it splits evenly over the replicas."""
        return self.replication.size

    def strategy(self, unit: UnitView) -> ReplicaShard:
        """Cut `unit`'s piece (after its shard was taken: one unit's fp32 shard at a time beside the pieces)."""
        return ReplicaShard(unit, self)


class NoReplicas:
    """shard_optimizer_state off, or one replica: no shard is split; every unit steps its whole shard."""

    align = 1

    def strategy(self, unit: UnitView) -> WholeShard:
        return WHOLE_SHARD


def replica_comm(enabled: bool, topology: Topology, engine: Engine) -> ReplicaComm | NoReplicas:
    """[Note: the replica strategy]
    Each unit holds a strategy for what the optimizer steps of it (`Unit.replicas`): `ReplicaShard`, this
    rank's piece of the shard, when shard_optimizer_state splits anything (on, and more than one
    replica); else `WholeShard`, the unit's own shard, main grad and slices. Both answer the same calls
    -- values, grad, slices, the boundary's reduction, the refresh after a step, full values -- so no
    caller asks which one it has."""
    replication = topology.replication
    if not enabled or replication.size == 1:
        return NoReplicas()
    return ReplicaComm(engine, replication, replication.rank_of(topology.rank))


class UnitView(Protocol):
    """What a ReplicaShard reads and writes of its unit (runtime/unit.py's Unit)."""

    layout: FlatLayout
    comm: UnitComm
    policy: DtypePolicy
    compute_dtype: torch.dtype
    slices: tuple[ParamSlice, ...]
    main_shard: torch.Tensor
    main_grad: torch.Tensor | None

    def compute_shard(self) -> torch.Tensor: ...

    def refresh_compute(self) -> None: ...

    def refresh_compute_copy(self) -> None: ...

    def average_main_grad(self) -> None: ...


U = TypeVar("U", bound=UnitView)


class WholeShard:
    """No replica piece ([Note: the replica strategy]): the optimizer steps the unit's whole shard, the
    boundary AllReduces its main grad over the replication group, a step refreshes its compute copy.
    Stateless: one instance serves every unit."""

    splits = False
    gathers_over_replicas = False

    def main_of(self, unit: UnitView) -> torch.Tensor:
        return unit.main_shard

    def grad_of(self, unit: UnitView) -> torch.Tensor | None:
        return unit.main_grad

    def slices_of(self, unit: UnitView) -> tuple[ParamSlice, ...]:
        return unit.slices

    def grad_holder(self, unit: U) -> U:
        """What holds the main grad the optimizer steps (user_params.py reads and writes `.main_grad`)."""
        return unit

    def clear_grad(self, *, set_to_none: bool) -> None:
        """Nothing of its own: the unit's main grad is cleared with the unit (ShardedState.clear_grads)."""

    def own_tensors(self) -> list[torch.Tensor]:
        """Tensors it keeps beside the unit's (the wrap summary's memory count): none."""
        return []

    def finish_accumulation(self, unit: UnitView) -> None:
        unit.average_main_grad()  # the replication AllReduce

    def fold(self, unit: UnitView, block: torch.Tensor, *, scale: float) -> None:
        raise AssertionError(f"unit {getattr(unit, 'name', '?')} has no replica piece")

    def take_grad(self, reduced: torch.Tensor) -> None:
        raise AssertionError("a replica piece's gradient for a unit without a replica piece")

    def refresh(self, unit: UnitView) -> None:
        unit.refresh_compute_copy()

    def main_shard_values(self, unit: UnitView) -> torch.Tensor:
        return unit.main_shard

    def load_full(self, unit: UnitView, values: dict[str, torch.Tensor]) -> None:
        """Set the main shard from full parameter values, then its compute copy."""
        for sl in unit.slices:
            if sl.length and sl.spec.fqn in values:
                unit.main_shard[sl.local].copy_(values[sl.spec.fqn].reshape(-1)[sl.param])
        unit.refresh_compute()


WHOLE_SHARD = WholeShard()


class ReplicaShard:
    """This rank's piece of one unit's shard: fp32 main values, main grad ([Note: replica-sharded main])."""

    splits = True

    def __init__(self, unit: UnitView, comm: ReplicaComm) -> None:
        layout = unit.layout
        self.comm = comm
        self.numel = layout.shard_numel // comm.size
        owned = owned_layout(layout, comm.size)  # raises unless the layout was aligned to the replicas
        self.lo = comm.index * self.numel
        # Each parameter's part of the piece: Piece.local / start / length in runtime/state.py.
        self.slices: tuple[ParamSlice, ...] = owned.slices(unit.comm.shard_index * comm.size + comm.index)
        self.fp32_shard = unit.compute_dtype == torch.float32
        piece = unit.main_shard[self.lo : self.lo + self.numel]
        if self.fp32_shard:
            self.main = piece  # the fp32 shard is the compute shard: the piece is a view of it
        else:
            self.main = piece.clone()
            unit.main_shard = piece.new_empty(0)  # the only fp32 values kept are the piece's
        self.main_grad: torch.Tensor | None = None

    @property
    def gathers_over_replicas(self) -> bool:
        """Whether the unit's full fp32 values need the other replicas' pieces (no fp32 shard is kept)."""
        return not self.fp32_shard

    # ---- what the optimizer steps ([Note: the replica strategy]) ----------------------------------

    def main_of(self, unit: UnitView) -> torch.Tensor:
        return self.main

    def grad_of(self, unit: UnitView) -> torch.Tensor | None:
        return self.main_grad

    def slices_of(self, unit: UnitView) -> tuple[ParamSlice, ...]:
        return self.slices

    def grad_holder(self, unit: UnitView) -> ReplicaShard:
        return self

    def own_tensors(self) -> list[torch.Tensor]:
        """Tensors it keeps beside the unit's (the wrap summary's memory count): the fp32 piece."""
        return [self.main]

    def clear_grad(self, *, set_to_none: bool) -> None:
        if set_to_none:
            self.main_grad = None
        elif self.main_grad is not None:
            self.main_grad.zero_()

    # ---- gradients ---------------------------------------------------------------------------

    def finish_accumulation(self, unit: UnitView) -> None:
        """At the accumulation boundary: ReduceScatter (AVG) the shard's main grad over the replication
        group in the reduce dtype; this rank keeps its piece, the shard-sized main grad goes."""
        grad = unit.main_grad
        if grad is None:  # alike on every rank: trainable units always have one after a backward
            return
        unit.main_grad = None
        reduce = unit.policy.reduce
        src = grad if grad.dtype == reduce else grad.to(reduce)
        out = torch.empty(self.numel, dtype=reduce, device=grad.device)
        self.comm.engine.reduce_scatter(out, src, self.comm.replication, op=ReduceOp.AVG)
        self.take_grad(out)

    def take_grad(self, reduced: torch.Tensor) -> None:
        """This rank's replication-averaged piece of a window's gradient: becomes the main grad, or is
        added to the one an earlier step left (no zero_grad in between, as plain PyTorch allows)."""
        if self.main_grad is None:
            self.main_grad = reduced if reduced.dtype == torch.float32 else reduced.float()
        else:
            self.main_grad.add_(reduced)

    def fold(self, unit: UnitView, block: torch.Tensor, *, scale: float) -> None:
        """sdp 1, the boundary backward: turn `block`, the unit's [R, w/R] rows of a bucket (reduce
        dtype), into what `finish_accumulation` would ReduceScatter -- the window's main grad plus
        `scale` x this micro-step, rounded once -- and drop the shard-sized main grad."""
        if unit.main_grad is not None:
            torch.add(unit.main_grad.view(block.shape), block, alpha=scale, out=block)
            unit.main_grad = None
        elif scale != 1.0:
            block.copy_(block.float().mul_(scale))

    # ---- values ------------------------------------------------------------------------------

    def refresh(self, unit: UnitView) -> None:
        """After the piece changed (a step, a load): AllGather every replica's piece, in the compute
        dtype, into the unit's compute shard. Collective over the replication group."""
        if unit.layout.numel == 0:
            return
        shard = unit.compute_shard()
        # A copy even in fp32, where `main` is a view of `shard`: the engine must not read what it writes.
        src = self.main.to(shard.dtype, copy=True)
        self.comm.engine.all_gather(shard, src, self.comm.replication)

    def main_shard_values(self, unit: UnitView) -> torch.Tensor:
        """The unit's whole fp32 shard: the shard itself in fp32, else the replicas' pieces gathered."""
        if self.fp32_shard:
            return unit.main_shard
        shard = torch.empty(unit.layout.shard_numel, dtype=torch.float32, device=self.main.device)
        self.comm.engine.all_gather(shard, self.main, self.comm.replication)
        return shard

    def load_full(self, unit: UnitView, values: dict[str, torch.Tensor]) -> None:
        """Set the compute shard and the fp32 piece from full parameter values (every rank passes the
        same values, so no collective is needed)."""
        shard = unit.compute_shard()
        for sl in unit.slices:
            if sl.length and sl.spec.fqn in values:
                shard[sl.local].copy_(values[sl.spec.fqn].reshape(-1)[sl.param])
        if self.fp32_shard:
            return  # `main` is a view of the shard just written
        for sl in self.slices:
            if sl.length and sl.spec.fqn in values:
                self.main[sl.local].copy_(values[sl.spec.fqn].reshape(-1)[sl.param])
