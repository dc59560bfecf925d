"""Owner compute: a shape-aware optimizer (Muon, Adafactor, Shampoo, anything not element-wise)
steps each sharded parameter whole, on one owner rank.

[Note: owner compute]
Each rank of the exchange group (the sharding group; with shard_optimizer_state the rdp group, whose
pieces are disjoint) holds a piece of every sharded parameter. A shape-aware optimizer needs the whole
matrix, so each such parameter gets one owner in that group (ownership.py balances the work and the
bytes), and the user's own optimizer object holds, for that parameter, a leaf of the parameter's full
shape on the owner and an empty leaf elsewhere (no .grad ever: torch optimizers skip it, so its state
lives on the owner only). One `opt.step()`:

    clip / unscale the main grads (optimizer.py)        every rank, on its pieces, as today
    gather   all_to_all: row d = my grad pieces of the parameters d owns  -> owner rebuilds whole grads
             (+ the values, only when they changed outside an owner step: first step, a load, a write)
    TP       a TP-split parameter's owners AllGather their TP-local wholes over the TP group: the owner
             steps the TP-merged matrix, as one process would (each TP rank's owner alike)
    step     the user's optimizer: element-wise pieces and owned wholes in the same call
    scatter  all_to_all: row d = the updated values of d's pieces of my parameters -> main shards

Each all_to_all sends equal blocks (the engines' contract), padded to the largest (source, owner) pair
of the plan (a rank's own pieces of what it owns are copied in place, not sent); bytes per rank and step
are 2 x n x block x 4 as the counting engine counts them (input, own block included), of which
2 x (n - 1) x block x 4 leave the rank.
The owner keeps its whole fp32 copy between steps instead of gathering values each step: one third
less traffic for the memory of one more copy of the parameters it owns (its share, ~1/n of them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardpar.optim.ownership import OwnerPlan, plan_owners
from shardpar.optim.sharded_state import OptimizerState, Piece


@dataclass
class _Owned:
    piece: Piece
    owner: int  # member index
    ranges: list[tuple[int, int]]  # (start, length) each member holds
    local_shape: tuple[int, ...]  # as this TP rank holds the parameter
    leaf: nn.Parameter  # whole (TP-merged) on the owner, empty elsewhere


class OwnerCompute:
    def __init__(self, view: OptimizerState, pieces: Sequence[Piece], kind: str) -> None:
        self.view = view
        self.group = view.exchange_group()
        self.me = self.group.rank_of(view.topology.rank)
        n = self.group.size
        tp = view.topology.tp.size
        shapes = [(p.fqn, self._merged_shape(p)) for p in pieces]
        self.plan: OwnerPlan = plan_owners(shapes, kind, n)
        self.owned: list[_Owned] = []
        for piece, planned in zip(pieces, self.plan.owned, strict=True):
            mine = planned.owner == self.me
            device = view.main(piece).device
            data = torch.zeros(planned.shape if mine else (0,), dtype=torch.float32, device=device)
            leaf = nn.Parameter(data, requires_grad=piece.param.requires_grad)
            self.owned.append(_Owned(piece, planned.owner, view.member_ranges(piece), piece.shape, leaf))
        # counts[s][d]: elements member s holds of the parameters member d owns; every rank agrees. A
        # member's own pieces of what it owns never travel (copied in place), so the diagonal is not sent.
        counts = [[0] * n for _ in range(n)]
        for o in self.owned:
            for s, (_, length) in enumerate(o.ranges):
                if s != o.owner:
                    counts[s][o.owner] += length
        self.block = max((c for row in counts for c in row), default=0)
        self._tp = tp
        self._seen_version = -1  # values never read yet

    def _merged_shape(self, piece: Piece) -> tuple[int, ...]:
        split = self.view.tp_splits.get(piece.fqn)
        return piece.shape if split is None else tuple(split.full_shape(piece.shape))

    def leaf(self, piece: Piece) -> nn.Parameter | None:
        for o in self.owned:
            if o.piece is piece:
                return o.leaf
        return None

    def leaves(self) -> dict[int, nn.Parameter]:
        """id(compute parameter) -> the leaf the user's optimizer steps for it."""
        return {id(o.piece.param): o.leaf for o in self.owned}

    # ---- the step --------------------------------------------------------------------------------

    def gather(self, skip: set[int]) -> None:
        """Before the optimizer's step: owners get whole grads (and whole values when they changed)."""
        if not self.owned:
            return
        if self._seen_version != self.view.values_version:
            self._set_whole(self._to_owners(self.view.main), grad=False)
        self._set_whole(self._to_owners(self.view.grad), grad=True, skip=skip)

    def scatter(self) -> None:
        """After the optimizer's step: every member's pieces of the updated owned parameters."""
        if not self.owned:
            return
        n = self.group.size
        send = torch.zeros(n, self.block, dtype=torch.float32, device=self._device())
        fill = [0] * n
        with torch.no_grad():
            for o in self.owned:
                if o.owner != self.me:
                    continue
                flat = self._local_whole(o).reshape(-1)
                for d, (start, length) in enumerate(o.ranges):
                    if d == self.me:
                        if length:
                            self.view.main(o.piece).copy_(flat[start : start + length])
                        continue
                    send[d, fill[d] : fill[d] + length] = flat[start : start + length]
                    fill[d] += length
                o.leaf.grad = None  # the whole grad is this step's only
            recv = self._all_to_all(send)
            taken = [0] * n
            for o in self.owned:
                if o.owner == self.me:
                    continue
                start, length = o.ranges[self.me]
                if length:
                    self.view.main(o.piece).copy_(recv[o.owner, taken[o.owner] : taken[o.owner] + length])
                taken[o.owner] += length

    def mark_values_current(self) -> None:
        """After the step's refresh: the owners' copies are what the shards hold."""
        self._seen_version = self.view.values_version

    def forget_values(self) -> None:
        """The owners' copies may differ from the shards (written outside a step): gather at the next step."""
        self._seen_version = -1

    # ---- pieces <-> wholes -----------------------------------------------------------------------

    def _to_owners(self, read: object) -> list[torch.Tensor | None]:
        """One all_to_all: each owned parameter whole on its owner (this TP rank's part), None elsewhere.
        `read(piece)`: this rank's piece (main values or main grad; None: zeros are sent)."""
        n = self.group.size
        send = torch.zeros(n, self.block, dtype=torch.float32, device=self._device())
        fill = [0] * n
        for o in self.owned:
            _, length = o.ranges[self.me]
            if o.owner == self.me:
                continue  # read in place below
            if length:
                mine = read(o.piece)  # type: ignore[operator]
                if mine is not None:
                    send[o.owner, fill[o.owner] : fill[o.owner] + length] = mine.reshape(-1)
            fill[o.owner] += length
        recv = self._all_to_all(send)
        out: list[torch.Tensor | None] = []
        taken = [0] * n
        for o in self.owned:
            if o.owner != self.me:
                out.append(None)
                continue
            whole = torch.zeros(o.piece.shape, dtype=torch.float32, device=send.device).view(-1)
            for s, (start, length) in enumerate(o.ranges):
                if s == self.me:
                    mine = read(o.piece) if length else None  # type: ignore[operator]
                    if mine is not None:
                        whole[start : start + length] = mine.reshape(-1)
                    continue
                whole[start : start + length] = recv[s, taken[s] : taken[s] + length]
                taken[s] += length
            out.append(whole.view(o.local_shape))
        return out

    def _set_whole(self, wholes: list[torch.Tensor | None], *, grad: bool, skip: set[int] | None = None) -> None:
        for o, whole in zip(self.owned, wholes, strict=True):
            if o.owner != self.me:
                continue
            if whole is None:
                raise AssertionError(f"owner {self.me} received no whole value for a parameter it owns")
            merged = self._tp_merge(o, whole)
            if grad:
                o.leaf.grad = None if skip is not None and id(o.piece.param) in skip else merged
            else:
                with torch.no_grad():
                    o.leaf.copy_(merged)

    def _tp_merge(self, o: _Owned, local: torch.Tensor) -> torch.Tensor:
        """The TP-merged whole from every TP rank's owner (the same member on each): one AllGather."""
        split = self.view.tp_splits.get(o.piece.fqn)
        if split is None:
            return local
        tp = self.view.topology.tp
        out = torch.empty(tp.size * local.numel(), dtype=local.dtype, device=local.device)
        self.view.engine.all_gather(out, local.reshape(-1).contiguous(), tp)
        return split.full_of(list(out.view(tp.size, *local.shape).unbind(0)))

    def _local_whole(self, o: _Owned) -> torch.Tensor:
        """This TP rank's part of the owner's updated whole."""
        split = self.view.tp_splits.get(o.piece.fqn)
        data = o.leaf.detach()
        return data if split is None else split.local_of(data, self.view.topology.coords.tp_rank).contiguous()

    def _all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        recv = torch.empty_like(send)
        if self.group.size == 1 or self.block == 0:
            return send
        self.view.engine.all_to_all(recv.view(-1), send.view(-1), self.group)
        return recv

    def _device(self) -> torch.device:
        return self.owned[0].leaf.device

    # ---- what it costs -----------------------------------------------------------------------------

    def bytes_per_step(self) -> int:
        """The counting engine's all_to_all bytes of one step on this rank (values gathered not counted)."""
        return 0 if self.group.size == 1 or self.block == 0 else 2 * self.group.size * self.block * 4

    def state_bytes(self, state: dict[object, dict[str, object]]) -> int:
        """Bytes of the optimizer state this rank holds for the parameters it owns."""
        total = 0
        for o in self.owned:
            for v in state.get(o.leaf, {}).values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total
