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


@dataclass
class GradReducer:
    engine: Engine
    sharding: Group
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

    def __post_init__(self) -> None:
        self._to_come = self.trainable_width

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
        if self.sharding.size == 1:
            out = bucket.reshape(-1)  # sdp 1: the bucket (a fresh buffer, one row) is the reduced shard
        else:
            out = torch.empty(bucket.shape[1], dtype=self.reduce_dtype, device=self.device)
            work = self.engine.reduce_scatter(out, bucket.reshape(-1), self.sharding, op=ReduceOp.AVG, async_op=True)
        self._inflight.append(_Inflight(work, self._pending, out))
        self._pending, self._pending_numel, self._buffer, self._used = [], 0, None, 0

    def drain(self, *, scale: float = 1.0) -> None:
        """Flush, wait for every bucket, and add the reduced shards, times `scale`, into the units'
        main grads (see [Note: micro-batch averaging] in model.py)."""
        self.flush()
        self._to_come = self.trainable_width  # the next backward starts with every unit to come
        for item in self._inflight:
            item.work.wait()
            col = 0
            for unit in item.units:
                width = unit.layout.shard_numel
                unit.accumulate_main_grad(item.out[col : col + width], scale=scale)
                col += width
        self._inflight = []
