"""Gradient ReduceScatter in buckets of up to `sdp_reduce_bucket_size` elements (reference 003).

Units whose backward finished are packed rank-major -- shard r of every unit in the bucket side by
side -- so ONE ReduceScatter hands each rank exactly its shards of all of them:

    unit A (shard 3), unit B (shard 2), 2 ranks:
    bucket  = [ A0 A0 A0 B0 B0 | A1 A1 A1 B1 B1 ]   (row r = what rank r receives)
    rank 0 <- [A0 A0 A0 B0 B0]  = its main-grad pieces of A and B

A full bucket is issued asynchronously (the engine's thread / NCCL stream runs it while backward
goes on); the results are added to the fp32 main grads when the bucket is drained -- at the next
flush or at the end of backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardpar.collectives import Engine, Group, ReduceOp, Work
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
    _pending: list[tuple[Unit, torch.Tensor]] = field(default_factory=list)
    _pending_numel: int = 0
    _inflight: list[_Inflight] = field(default_factory=list)

    def add(self, unit: Unit) -> None:
        """Take the unit's grads (freeing them) into the open bucket; issue it once full. A unit that
        would overflow a non-empty bucket starts the next one, so a bucket holds at most bucket_size
        elements unless a single unit is bigger than that (then it goes alone)."""
        if self._pending and self._pending_numel + unit.layout.padded_numel > self.bucket_size:
            self.flush()
        self._pending.append((unit, unit.pack_grads(self.reduce_dtype)))
        self._pending_numel += unit.layout.padded_numel
        unit.reduced = True
        if self._pending_numel >= self.bucket_size:
            self.flush()

    def flush(self) -> None:
        """Issue the open bucket's ReduceScatter asynchronously."""
        if not self._pending:
            return
        units = [u for u, _ in self._pending]
        packed = [g for _, g in self._pending]
        bucket = packed[0] if len(packed) == 1 else torch.cat(packed, dim=1)
        out = torch.empty(bucket.shape[1], dtype=self.reduce_dtype, device=self.device)
        work = self.engine.reduce_scatter(out, bucket.reshape(-1), self.sharding, op=ReduceOp.AVG, async_op=True)
        self._inflight.append(_Inflight(work, units, out))
        self._pending, self._pending_numel = [], 0

    def drain(self, *, scale: float = 1.0) -> None:
        """Flush, wait for every bucket, and add the reduced shards, times `scale`, into the units'
        main grads (see [Note: micro-batch averaging] in model.py)."""
        self.flush()
        for item in self._inflight:
            item.work.wait()
            col = 0
            for unit in item.units:
                width = unit.layout.shard_numel
                unit.accumulate_main_grad(item.out[col : col + width], scale=scale)
                col += width
        self._inflight = []
