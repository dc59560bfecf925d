"""Gradient ReduceScatter in buckets of up to `sdp_reduce_bucket_size` elements (reference 003).

Units whose backward finished are packed rank-major -- shard r of every unit in the bucket side by
side -- so ONE ReduceScatter hands each rank exactly its shards of all of them:

    unit A (shard 3), unit B (shard 2), 2 ranks:
    bucket  = [ A0 A0 A0 B0 B0 | A1 A1 A1 B1 B1 ]   (row r = what rank r receives)
    rank 0 <- [A0 A0 A0 B0 B0]  = its main-grad pieces of A and B

A full bucket is issued asynchronously (the engine's thread / NCCL stream runs it while backward
goes on); the results are added to the fp32 main grads when the bucket is drained -- at the next
flush or at the end of backward.

[Note: bucket packing]
A bucket's [num_shards, width] buffer is allocated when its first unit arrives, as wide as the bucket
may grow (sdp_reduce_bucket_size / num_shards columns, but no wider than the trainable units still to
come in this backward), and every unit packs its gradients straight into its column range. With the
default bucket (the whole model) the buffer is filled exactly and sent as it is. Packing each unit
into a block of its own and `torch.cat`-ing the blocks at flush cost a second model-sized buffer and
~85 ms a step at 25M parameters (docs/performance.md, fix 1). A bucket closed before it is full
(a smaller sdp_reduce_bucket_size) is copied once into a contiguous buffer, as the cat did.

[Note: replication in the bucket]
With sdp 1 (plain data parallelism, reference 001's balanced fusion buffer) a bucket needs no
ReduceScatter: it IS this rank's reduced shard the moment it closes. In the backward that ends an
accumulation window the replication AllReduce is therefore issued on the bucket right then,
asynchronously, so the AllReduce of early buckets runs while backward computes the rest, instead of
one AllReduce per unit after backward (`Unit.finish_accumulation`). Each unit first folds what the
boundary would have reduced into its column range -- earlier micro-steps' main grad + scale x this
one, rounded once to the reduce dtype (`Unit.fold_main_grad`) -- so the values are bit-identical.
With sdp > 1 the AllReduce would need the ReduceScatter's result (and, under accumulation, the main
grad added to it) first, so it stays at the boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardpar.collectives import CompletedWork, Engine, Group, ReduceOp, Work
from shardpar.unit import Unit


@dataclass
class _Inflight:
    work: Work
    units: list[Unit]
    out: torch.Tensor
    replicated: bool = False  # `out` holds final main grads, AllReduced over the replication group


@dataclass
class GradReducer:
    engine: Engine
    sharding: Group
    replication: Group
    reduce_dtype: torch.dtype
    bucket_size: int
    device: torch.device
    # Columns (shard elements) of every trainable unit: what one backward reduces in all.
    trainable_width: int = 0
    _pending: list[Unit] = field(default_factory=list)
    _pending_numel: int = 0
    _buffer: torch.Tensor | None = None  # the open bucket, [num_shards, capacity]
    _used: int = 0  # columns of _buffer filled so far
    _to_come: int = 0  # trainable columns not yet added in this backward
    _inflight: list[_Inflight] = field(default_factory=list)
    # Set by begin_backward: fold and AllReduce each bucket at flush ([Note: replication in the bucket]).
    _replicate_scale: float | None = None

    def __post_init__(self) -> None:
        self._to_come = self.trainable_width

    def begin_backward(self, *, boundary: bool, scale: float) -> None:
        """Called as each backward starts; `boundary` = it ends an accumulation window, `scale` = the
        factor its gradients enter the main grads with ([Note: micro-batch averaging] in model.py)."""
        fold = boundary and self.sharding.size == 1 and self.replication.size > 1
        self._replicate_scale = scale if fold else None

    @property
    def replicates(self) -> bool:
        """Whether this backward's buckets carry the replication AllReduce (then the boundary skips it)."""
        return self._replicate_scale is not None

    def add(self, unit: Unit) -> None:
        """Take the unit's grads (freeing them) into the open bucket; issue it once full. A unit that
        would overflow a non-empty bucket starts the next one, so a bucket holds at most bucket_size
        elements unless a single unit is bigger than that (then it goes alone)."""
        n, width = unit.layout.num_shards, unit.layout.shard_numel
        if self._pending and self._pending_numel + unit.layout.padded_numel > self.bucket_size:
            self.flush()
        if self._buffer is not None and self._used + width > self._buffer.shape[1]:
            self.flush()  # more units than trainable_width promised: never write past the buffer
        if self._buffer is None:
            capacity = max(width, min(self.bucket_size // n, self._to_come))
            self._buffer = torch.empty(n, capacity, dtype=self.reduce_dtype, device=self.device)
        unit.pack_grads(self._buffer[:, self._used : self._used + width])
        self._used += width
        self._to_come = max(0, self._to_come - width)
        self._pending.append(unit)
        self._pending_numel += unit.layout.padded_numel
        unit.reduced = True
        if self._pending_numel >= self.bucket_size:
            self.flush()

    def flush(self) -> None:
        """Issue the open bucket's ReduceScatter asynchronously."""
        if not self._pending or self._buffer is None:
            return
        bucket = self._buffer if self._used == self._buffer.shape[1] else self._buffer[:, : self._used].contiguous()
        work: Work = CompletedWork()
        if self._replicate_scale is not None:
            out = bucket.reshape(-1)  # sdp 1: the bucket (a fresh buffer, one row) is the reduced shard
            self._fold(out, self._replicate_scale)
            work = self.engine.all_reduce(out, self.replication, op=ReduceOp.AVG, async_op=True)
        elif self.sharding.size == 1:
            out = bucket.reshape(-1)
        else:
            out = torch.empty(bucket.shape[1], dtype=self.reduce_dtype, device=self.device)
            work = self.engine.reduce_scatter(out, bucket.reshape(-1), self.sharding, op=ReduceOp.AVG, async_op=True)
        self._inflight.append(_Inflight(work, self._pending, out, replicated=self._replicate_scale is not None))
        self._pending, self._pending_numel, self._buffer, self._used = [], 0, None, 0

    def _fold(self, out: torch.Tensor, scale: float) -> None:
        for unit, piece in self._unit_pieces(self._pending, out):
            unit.fold_main_grad(piece, scale=scale)

    @staticmethod
    def _unit_pieces(units: list[Unit], out: torch.Tensor) -> list[tuple[Unit, torch.Tensor]]:
        pieces, col = [], 0
        for unit in units:
            width = unit.layout.shard_numel
            pieces.append((unit, out[col : col + width]))
            col += width
        return pieces

    def drain(self, *, scale: float = 1.0) -> None:
        """Flush, wait for every bucket, and add the reduced shards, times `scale`, into the units'
        main grads (see [Note: micro-batch averaging] in model.py)."""
        self.flush()
        self._to_come = self.trainable_width  # the next backward starts with every unit to come
        for item in self._inflight:
            item.work.wait()
            for unit, piece in self._unit_pieces(item.units, item.out):
                if item.replicated:
                    unit.adopt_main_grad(piece)
                else:
                    unit.accumulate_main_grad(piece, scale=scale)
        self._inflight = []
