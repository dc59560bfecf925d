"""A unit's gradients (Unit's mixin, unit.py): packed into a bucket for the ReduceScatter, or handed
over as spans of the autograd grads; accumulated in fp32 over the window into the main grad; averaged
over the replication group at the boundary."""

from __future__ import annotations

import torch
from torch import nn

from shardpar.collectives import ReduceOp, Span
from shardpar.precision import DtypePolicy
from shardpar.runtime.unit_comm import UnitComm
from shardpar.sharding.layout import FlatLayout, ParamSlice


class UnitGrads:
    """The gradient half of Unit; the attributes below are Unit's (set in Unit.__init__)."""

    params: list[nn.Parameter]
    layout: FlatLayout
    comm: UnitComm
    policy: DtypePolicy
    main_grad: torch.Tensor | None
    grad_used: list[bool]
    grads_arrived: int
    reduced: bool
    _row_slices: list[tuple[ParamSlice, ...]] | None

    def pack_grads(self, out: torch.Tensor) -> None:
        """Write the unit's gradients into `out`, its [num_shards, shard_numel] column range of a
        bucket (row r = shard r; rows may be strided, see reducer.py; or [nodes, local, shard_numel],
        shard r at [r // local, r % local], for a two-hop bucket: [Note: two-hop ReduceScatter]), with
        zero padding and zeros for parameters without a gradient; free the autograd grads.

        Every rank reduces every trainable unit exactly once per backward, gradient or not, so the
        collectives line up whatever the graph did.
        """
        n, width = self.layout.num_shards, self.layout.shard_numel
        # No zero-fill first: the parameters lie end to end from offset 0 (layout.py), so every element
        # is written once below -- a grad, a zero for a missing grad, or the zero padding tail.
        # Zero-filling the whole block first cost ~55 ms a step at 25M parameters (docs/performance-history.md).
        flat = out.view(-1) if out.is_contiguous() else None
        for spec, grad in zip(self.layout.specs, self.take_grads(), strict=True):
            _write_flat(out, flat, spec.offset, spec.numel, grad)  # copy_ casts to the bucket's dtype
        _write_flat(out, flat, self.layout.numel, n * width - self.layout.numel, None)

    def take_grads(self, dtype: torch.dtype | None = None) -> list[torch.Tensor | None]:
        """Take the gradients off the parameters (freeing them) and mark them used: flat, in `dtype`
        when given, None where a parameter got none. pack_grads copies them into a bucket; a reducer
        whose engine reads them in place keeps them ([Note: gradients read in place] in reducer.py)."""
        grads: list[torch.Tensor | None] = []
        for i, p in enumerate(self.params):
            grad = p.grad
            if grad is not None:
                p.grad = None
                self.grad_used[i] = True
                grad = grad.reshape(-1) if dtype is None else grad.reshape(-1).to(dtype)  # views where they can
            grads.append(grad)
        return grads

    def grad_spans(self, grads: list[torch.Tensor | None], row: int) -> list[Span]:
        """Row `row` of the unit's [num_shards, shard_numel] gradient block -- what pack_grads would write
        there -- as spans of `grads` (from take_grads): zero counts for missing grads and padding."""
        if self._row_slices is None:
            self._row_slices = [self.layout.slices(r) for r in range(self.layout.num_shards)]
        spans: list[Span] = []
        for sl, grad in zip(self._row_slices[row], grads, strict=True):
            if sl.length:
                spans.append(sl.length if grad is None else grad[sl.param])
        padding = self.layout.shard_numel - sum(sl.length for sl in self._row_slices[row])
        if padding:
            spans.append(padding)
        return spans

    def accumulate_main_grad(self, reduced: torch.Tensor, *, scale: float = 1.0) -> None:
        """Add one micro-step's reduced shard gradient times `scale` (fp32 accumulation). `reduced` is
        this unit's slice of a bucket's fresh ReduceScatter output, used by nothing else afterwards,
        so an fp32 one is adopted as the main grad instead of cloned (~21 ms a step at 25M)."""
        if self.main_grad is None:
            self.main_grad = reduced.float() if reduced.dtype != torch.float32 else reduced
            if scale != 1.0:
                self.main_grad.mul_(scale)
        else:
            self.main_grad.add_(reduced, alpha=scale)

    def fold_main_grad(self, reduced: torch.Tensor, *, scale: float) -> None:
        """sdp 1, last micro-step of the window: turn `reduced` (this unit's slice of a bucket, in the
        reduce dtype) into exactly what `finish_accumulation` would AllReduce -- the main grad after
        `accumulate_main_grad(reduced, scale)`, rounded once to the reduce dtype -- without keeping
        an fp32 copy ([Note: replication in the bucket] in reducer.py)."""
        if self.main_grad is not None:
            torch.add(self.main_grad, reduced, alpha=scale, out=reduced)  # computed in fp32, rounded once
        elif scale != 1.0:  # a window of one backward has scale 1; kept for exactness, not speed
            reduced.copy_(reduced.float().mul_(scale))

    def adopt_main_grad(self, replicated: torch.Tensor) -> None:
        """Take a folded, replication-averaged slice as the main grad (the counterpart of
        `finish_accumulation` for a bucket that was AllReduced as a whole)."""
        self.main_grad = replicated if replicated.dtype == torch.float32 else replicated.float()

    def average_main_grad(self) -> None:
        """The main grad's AllReduce AVG over the replication group (WholeShard.finish_accumulation)."""
        if self.main_grad is None or self.comm.replication.size == 1:
            return
        if self.policy.reduce == torch.float32:
            self.comm.engine.all_reduce(self.main_grad, self.comm.replication, op=ReduceOp.AVG)
        else:
            low = self.main_grad.to(self.policy.reduce)
            self.comm.engine.all_reduce(low, self.comm.replication, op=ReduceOp.AVG)
            self.main_grad.copy_(low)

    def begin_backward(self) -> None:
        self.grads_arrived = 0
        self.reduced = False

    def drop_stale_grads(self) -> None:
        """After a backward that raised: pack_grads and take_grads free every .grad they take, so one here is left over
        from a backward that raised before this unit was reduced, and autograd would add the next
        backward's gradient to it."""
        for p in self.params:
            p.grad = None


def _write_flat(
    block: torch.Tensor, flat: torch.Tensor | None, start: int, numel: int, src: torch.Tensor | None
) -> None:
    """block.view(-1)[start : start + numel] = src (zeros when src is None), for a [rows, width] block
    whose rows may be strided -- then the range is written row piece by row piece -- or a
    [nodes, local, width] one, row r at [r // local, r % local]."""
    if numel == 0:
        return
    if flat is not None:
        _fill(flat[start : start + numel], src)
        return
    width = block.shape[-1]
    rows = block if block.dim() == 2 else None
    pos = start
    while pos < start + numel:
        row, col = divmod(pos, width)
        take = min(width - col, start + numel - pos)
        line = rows[row] if rows is not None else block[row // block.shape[1], row % block.shape[1]]
        _fill(line[col : col + take], None if src is None else src[pos - start : pos - start + take])
        pos += take


def _fill(piece: torch.Tensor, src: torch.Tensor | None) -> None:
    if src is None:
        piece.zero_()
    else:
        piece.copy_(src)
