"""ShardedState: a read/write view of a DistributedModel's sharded state, for the optimizer, the grad
norm, checkpoints and state dicts. Code outside runtime/ reaches the shards only through it.

Per original parameter it names a `Piece`: the part of the parameter this rank holds (a range of a
unit's main shard, or all of a persistent parameter) and where that lies in its holder's flat fp32
main copy and main grad.

    unit main shard (this rank):   | w.a [start, start+length) | w.b ... | pad |
                                     ^ Piece.local                ^ next Piece.local
    persistent main (every rank):  | p0 | p1 | p2 |              Piece.local = [offset, offset+numel)

With shard_optimizer_state a unit's pieces are those of this rank's part of the shard, and `main` /
`grad` read that part's fp32 values and grad (`Unit.replicas`, [Note: replica-sharded main] in
replica_shard.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from shardpar.collectives import Engine, Group
from shardpar.runtime import unit_values, write_guard
from shardpar.runtime.frozen import FrozenShard
from shardpar.runtime.persistent import PersistentParams
from shardpar.runtime.unit import Unit
from shardpar.sharding.layout import ParamSlice, owned_layout
from shardpar.topology import Topology


@dataclass(frozen=True)
class Piece:
    """One original parameter as this rank holds it."""

    fqn: str  # its name in its unit's layout or the persistent table (a tied parameter: one of its names)
    param: nn.Parameter
    shape: tuple[int, ...]  # the parameter's
    sharded: bool  # False: a persistent parameter, whole on every rank
    start: int  # this rank holds flat elements [start, start + length) of the parameter
    length: int
    unit: int  # index of the unit holding it; -1 when persistent
    pos: int  # its position in the unit, or in the persistent set
    offset: int  # where the parameter starts in its holder's full flat values (gather_unit / persistent_main)
    local: slice  # its range in the holder's local flat main copy and main grad
    frozen: bool = False  # frozen at wrap time: `local` is in the unit's frozen shard, no grad ([Note: frozen shards])


@dataclass(frozen=True)
class GradBlock:
    """One flat fp32 main grad and the pieces it holds."""

    grad: torch.Tensor
    replicated: bool  # the same on every rank of the sharding group (persistent grads after their AllReduce)
    pieces: list[Piece]


class ShardedState:
    def __init__(
        self,
        units: list[Unit],
        persistent: PersistentParams,
        *,
        engine: Engine,
        topology: Topology,
        device: torch.device,
    ) -> None:
        self._units = units
        self._persistent = persistent
        self.engine = engine
        self.topology = topology
        self.device = device
        self._unit_pieces = [_unit_pieces(u) for u in units]
        self._persistent_pieces = _persistent_pieces(persistent)
        self.pieces: list[Piece] = [*(p for ps in self._unit_pieces for p in ps), *self._persistent_pieces]
        # id of a compute or user parameter -> its piece; the user parameters are added by user_params.py
        self._piece_of: dict[int, Piece] = {id(p.param): p for p in self.pieces}
        self._user_of: dict[int, torch.Tensor] = {}  # id(compute parameter) -> its user parameter
        self.main_written = False  # see mark_written
        # Bumped whenever main values may have changed other than by an owner step (a step of the
        # pieces, a load, a user write): owner compute re-reads the values it keeps whole then.
        self.values_version = 0
        # Bumped by every write of main values other than an optimizer step: a user's write through a user
        # parameter (`p.add_()`, `p.data = `; ShardedTensor writes below autograd, so the shard's version
        # counter does not move), a DCP load, a state-dict load. A frozen shard's cached checksum is
        # reused only while it stands ([Note: fingerprint cache] in checkpoint/fingerprint.py).
        self.writes = 0
        # shard_optimizer_state: the units' grads are disjoint over the rdp group, not only the sharding group.
        self.replica_sharded = any(u.replicas.splits for u in units)
        # ... and under bf16/fp16 no rank has a unit's full fp32 values without the other replicas.
        self.gathers_over_replicas = any(u.replicas.gathers_over_replicas for u in units)

    def add_user(self, piece: Piece, user: torch.Tensor) -> None:
        """The user parameter standing for `piece`'s parameter outside forward (user_params.py)."""
        self._piece_of[id(user)] = piece
        self._user_of[id(piece.param)] = user

    def piece_of(self, param: object) -> Piece | None:
        """The piece of a compute or user parameter of this model; None for anything else (a module
        holds the user parameter outside its unit's forward and the compute one inside)."""
        return self._piece_of.get(id(param))

    def piece_of_id(self, param_id: int) -> Piece | None:
        return self._piece_of.get(param_id)

    def user_of(self, piece: Piece) -> torch.Tensor:
        """The user parameter of `piece` (the compute one until user_params.py made it)."""
        return self._user_of.get(id(piece.param), piece.param)

    @property
    def num_units(self) -> int:
        return len(self._units)

    # ---- values and grads, piece by piece ---------------------------------------------------

    def main(self, piece: Piece) -> torch.Tensor:
        """The piece's fp32 main values (a view): flat when sharded, the parameter's shape when persistent."""
        if piece.sharded:
            unit = self._units[piece.unit]
            if piece.frozen and unit.frozen is not None:
                return unit.frozen.piece_views[piece.fqn]  # in the parameter's own dtype
            return unit.replicas.main_of(unit)[piece.local]
        return self._persistent.main_view(piece.pos)

    def quantized_frozen(self, piece: Piece) -> FrozenShard | None:
        """The frozen shard holding `piece` where it is quantized (int8 / nf4): its values are there only
        while given back ([Note: quantized base keeps no exact shard], frozen_exact.py); else None."""
        if not (piece.frozen and piece.sharded):
            return None
        frozen = self._units[piece.unit].frozen
        return frozen if frozen is not None and frozen.quantized else None

    def _quantized_shards(self) -> list[FrozenShard]:
        return [u.frozen for u in self._units if u.frozen is not None and u.frozen.quantized]

    def frozen_shard_private(self, piece: Piece) -> bool:
        """A frozen piece in a shard no module parameter views (FrozenShard.viewed_by_params)."""
        if not (piece.frozen and piece.sharded):
            return False
        frozen = self._units[piece.unit].frozen
        return frozen is not None and not frozen.viewed_by_params

    def grad(self, piece: Piece) -> torch.Tensor | None:
        """The piece's fp32 main grad (a view shaped like `main(piece)`); None when there is none."""
        if piece.frozen:
            return None
        if piece.sharded:
            grad = _stepped_grad(self._units[piece.unit])
            return None if grad is None else grad[piece.local]
        return self._persistent.grad_view(piece.pos)

    def main_grads(self) -> list[torch.Tensor]:
        """Every flat main grad that exists: the units', then the persistent one."""
        grads = [g for g in map(_stepped_grad, self._units) if g is not None]
        persistent = self._persistent.main_grad
        return grads + ([persistent] if persistent is not None else [])

    def grad_blocks(self) -> list[GradBlock]:
        """The main grads with the pieces they hold, in main_grads() order (for the grad norm)."""
        blocks = [
            GradBlock(grad, False, [p for p in pieces if not p.frozen])
            for grad, pieces in zip(map(_stepped_grad, self._units), self._unit_pieces, strict=True)
            if grad is not None
        ]
        if self._persistent.main_grad is not None:
            blocks.append(GradBlock(self._persistent.main_grad, True, self._persistent_pieces))
        return blocks

    # ---- owner compute ([Note: owner compute], optim/owner_compute.py) ---------------------------

    def exchange_group(self) -> Group:
        """The ranks whose pieces of a sharded parameter together make it whole: the sharding group, or
        with shard_optimizer_state the rdp group (the sharding group x its replicas)."""
        return self.topology.rdp if self.replica_sharded else self.topology.sharding

    def member_ranges(self, piece: Piece) -> list[tuple[int, int]]:
        """(start, length) of `piece`'s parameter held by each member of `exchange_group()`, in its order."""
        unit = self._units[piece.unit]
        if not self.replica_sharded:
            return [_range(unit.layout.slices(m), piece.pos) for m in range(unit.layout.num_shards)]
        sdp, replicas = unit.layout.num_shards, self.topology.replication.size
        owned = owned_layout(unit.layout, replicas)
        # rdp position q is replica q // sdp at sharding position q % sdp ([Note: replica-sharded main])
        return [_range(owned.slices((q % sdp) * replicas + q // sdp), piece.pos) for q in range(sdp * replicas)]

    # ---- after a step, between steps ----------------------------------------------------------

    def refresh_compute(self) -> None:
        """After the fp32 main values changed (a step, a load): update the compute-dtype copies."""
        self.main_written = False
        self.values_version += 1
        for unit in self._units:
            unit.refresh_compute()
        self._persistent.refresh_compute()

    def will_write(self, what: str = "an in-place write to a parameter") -> None:
        """Before main values are written (a user's in-place op, a load): wait for an async checkpoint
        still copying them ([Note: writes wait for staging] in write_guard.py)."""
        write_guard.before_write(what)

    def mark_written(self) -> None:
        """Main values were written outside an optimizer step (a plain torch optimizer on the user
        parameters, `p.data = ...`): the compute copies refresh before the next forward."""
        self.main_written = True
        self.values_version += 1
        self.writes += 1

    def refresh_if_written(self) -> None:
        """Before a forward: refresh after `mark_written`. Every rank runs the same writes (each rank's
        user parameters see the same ops, empty pieces included), so every rank refreshes alike -- a
        collective with shard_optimizer_state."""
        if self.main_written:
            self.refresh_compute()

    def clear_grads(self, *, set_to_none: bool) -> None:
        """Drop (set_to_none) or zero every main grad."""
        for holder in self._holders():
            if set_to_none:
                holder.main_grad = None
            elif holder.main_grad is not None:
                holder.main_grad.zero_()
        for unit in self._units:
            unit.replicas.clear_grad(set_to_none=set_to_none)  # a replica piece's own main grad

    def grad_used(self) -> list[bool]:
        """Whether each piece's parameter got a gradient in this window, in `pieces` order ([Note:
        unused params] in model.py)."""
        return [
            b
            for holder in self._holders()
            for b in [*holder.grad_used, *[False] * _num_frozen(holder)]  # a frozen one never has a grad
        ]

    def reset_grad_usage(self) -> None:
        """Forget which parameters got a gradient ([Note: unused params] in model.py)."""
        for holder in self._holders():
            holder.grad_used = [False] * len(holder.params)

    def _holders(self) -> list[Unit | PersistentParams]:
        """The units, then the persistent set: the order of `pieces`."""
        return [*self._units, self._persistent]

    # ---- full values --------------------------------------------------------------------------

    def gather_unit(self, index: int) -> torch.Tensor | None:
        """Unit `index`'s full flat fp32 main values, padded (one AllGather over the sharding group);
        a piece's parameter is at [offset, offset + numel). None for a unit without elements."""
        self.refresh_if_written()  # with shard_optimizer_state the fp32 shard holds other replicas' pieces
        return unit_values.gather_main(self._units[index])

    def persistent_main(self) -> torch.Tensor:
        """The persistent parameters' flat fp32 main values (the same on every rank); no copy."""
        return self._persistent.main

    def full_values(self) -> dict[str, torch.Tensor]:
        """Every parameter at full size, fp32, cloned, by piece name: gathered unit by unit."""
        self.refresh_if_written()
        out: dict[str, torch.Tensor] = {}
        for unit in self._units:
            out.update(unit_values.full_params(unit))
        for piece in self._persistent_pieces:
            out[piece.fqn] = self._persistent.main_view(piece.pos).detach().clone()  # fp32 main, not compute
        return out

    def load_full_values(self, values: Mapping[str, torch.Tensor]) -> None:
        """Set the parameters `values` names (by piece name, full size; every rank passes the same)."""
        self.will_write("model.load_state_dict()")
        self.values_version += 1
        self.writes += 1
        for unit, pieces in zip(self._units, self._unit_pieces, strict=True):
            unit_values.load_full_params(unit, {p.fqn: values[p.fqn] for p in pieces if p.fqn in values})
        self._persistent.load({p.fqn: values[p.fqn] for p in self._persistent_pieces if p.fqn in values})

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's piece of every parameter (1-D when sharded), cloned; a quantized frozen base's
        dequantized (frozen_exact.py)."""
        with contextlib.ExitStack() as reads:
            for frozen in self._quantized_shards():
                reads.enter_context(frozen.values_read())
            return {p.fqn: self.main(p).detach().clone() for p in self.pieces}

    def load_local_state_dict(self, values: Mapping[str, torch.Tensor]) -> None:
        """Take back `local_state_dict()` of this rank under the same topology; every check runs before
        anything is written. Another topology's pieces would land in the wrong places."""
        problems = [f"{p.fqn} missing" for p in self.pieces if p.fqn not in values]
        problems += [
            f"{p.fqn}: {list(values[p.fqn].shape)} here, this rank holds {list(self.main(p).shape)}"
            for p in self.pieces
            if p.fqn in values and tuple(values[p.fqn].shape) != tuple(self.main(p).shape)
        ]
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise ValueError(
                f"load_state_dict of a partial (local) state dict: {'; '.join(problems[:3])}{more}. A local state "
                "dict loads only into the rank and topology that saved it; to change world size, "
                "sharded_data_parallel_degree or tensor_parallel_degree use smp.save_checkpoint / "
                "smp.resume_from_checkpoint, which reshard"
            )
        self.will_write("model.load_state_dict() of a local state dict")
        self.writes += 1
        for frozen in self._quantized_shards():
            frozen.hold_values()  # the copy writes them; refresh_compute quantizes the new values
        with torch.no_grad():
            for p in self.pieces:
                self.main(p).copy_(values[p.fqn])
        self.refresh_compute()


def _range(slices: tuple[ParamSlice, ...], pos: int) -> tuple[int, int]:
    return slices[pos].param_start, slices[pos].length


def _stepped_grad(unit: Unit) -> torch.Tensor | None:
    """The fp32 main grad the optimizer steps the unit with: this rank's piece's with shard_optimizer_state."""
    return unit.replicas.grad_of(unit)


def _num_frozen(holder: Unit | PersistentParams) -> int:
    return len(holder.frozen.params) if isinstance(holder, Unit) and holder.frozen is not None else 0


def _unit_pieces(unit: Unit) -> list[Piece]:
    """The unit's trainable pieces, then its frozen ones, whose values start after the trainable ones in
    gather_unit's flat values ([Note: frozen shards])."""
    kinds = [(unit.params, unit.replicas.slices_of(unit), 0, False)]
    if unit.frozen is not None:
        kinds.append((unit.frozen.params, unit.frozen.slices, unit.layout.padded_numel, True))
    pieces: list[Piece] = []
    for params, slices, base, frozen in kinds:
        for p, sl in zip(params, slices, strict=True):
            pieces.append(
                Piece(
                    sl.spec.fqn,
                    p,
                    sl.spec.shape,
                    True,
                    sl.param_start,
                    sl.length,
                    unit.index,
                    len(pieces),
                    base + sl.spec.offset,
                    sl.local,
                    frozen=frozen,
                )
            )
    return pieces


def _persistent_pieces(persistent: PersistentParams) -> list[Piece]:
    out = []
    for i, ((name, p), off) in enumerate(zip(persistent.named, persistent.offsets, strict=True)):
        out.append(Piece(name, p, tuple(p.shape), False, 0, p.numel(), -1, i, off, slice(off, off + p.numel())))
    return out
