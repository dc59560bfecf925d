"""Where a TP rank's local parameter sits inside the full (Hugging Face) parameter: pure index math.

[Note: full-parameter coordinates]
A checkpoint addresses every element by its flat index in the FULL parameter (the unconverted
Hugging Face tensor), whatever tensor parallelism wrote or reads it. A TP-split parameter of full
shape S is cut along `dim` into `num_parts` blocks and each block into `size` pieces (TPSplit). Seen
as [A, num_parts, size, c, B] (A = prod S[:dim], c = S[dim] / (num_parts * size), B = prod S[dim+1:]),
TP rank r's local tensor is [:, :, r, :, :], flattened: a sequence of *runs* of L = c * B elements,
each contiguous in the full tensor:

    full, flattened (size 2):   | r0 run 0 | r1 run 0 | r0 run 1 | r1 run 1 | ...     (runs of L)
    local of TP rank 1:         | run 0    | run 1    | ...

    full_runs:  local i of rank r  ->  full ((i // L) * size + r) * L + i % L
    owners:     full f             ->  rank (f // L) % size,  local (f // L // size) * L + f % L

A column-parallel weight (dim 0, one part) is one run per rank; a row-parallel weight [out, in]
(dim 1) is one run of in / size elements per row. A reader's slice (a flat range of its local
tensor under its cut) is a list of full runs; each splits at the writers' run boundaries into
*segments* of one writer's local elements (`plan_fetch`). So a reader under ANY tensor-parallel
degree reads exactly the elements it keeps (`reads` merges a writer's adjacent segments into one
read): tp 2 -> 1 reads one range per writer, tp 1 -> 2 one run per row of a row-parallel weight. When the
writer's and the reader's cuts agree (the same tensor-parallel degree) the plan is the range itself.
The cost is Python work per segment (about numel / L), never per element.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from shardpar.sharding.tp_split import TPSplit


@dataclass(frozen=True)
class Cut:
    """A full parameter of `full_shape` cut over `size` TP ranks like `TPSplit(dim, size, num_parts)`;
    size 1 (dim 0, one part) means not split: the local tensor is the full one."""

    full_shape: tuple[int, ...]
    dim: int = 0
    size: int = 1
    num_parts: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or self.num_parts < 1:
            raise AssertionError(f"cut of {self.full_shape}: size {self.size}, num_parts {self.num_parts}")
        if self.size > 1 and not 0 <= self.dim < len(self.full_shape):
            raise AssertionError(f"cut of {self.full_shape} along dim {self.dim}")
        if self.size > 1 and self.full_shape[self.dim] % (self.size * self.num_parts):
            raise AssertionError(
                f"cut of {self.full_shape}: dim {self.dim} not divisible by {self.size} x {self.num_parts} parts"
            )

    @classmethod
    def of(cls, local_shape: Sequence[int], split: TPSplit | None) -> Cut:
        """The cut of a parameter whose TP-local shape is `local_shape` (`split` None: not TP-split)."""
        if split is None or split.size == 1:
            return cls(tuple(int(d) for d in local_shape))
        return cls(split.full_shape(local_shape), split.dim, split.size, split.num_parts)

    @property
    def numel(self) -> int:
        return math.prod(self.full_shape)

    @property
    def local_numel(self) -> int:
        return self.numel // self.size

    @property
    def run_length(self) -> int:
        """L: local elements that stay contiguous in the full tensor."""
        if self.size == 1:
            return max(self.numel, 1)
        inner = math.prod(self.full_shape[self.dim + 1 :])
        return max(self.full_shape[self.dim] // (self.num_parts * self.size) * inner, 1)

    def full_runs(self, rank: int, start: int, length: int) -> Iterator[tuple[int, int, int]]:
        """(offset in the range, full start, n): TP rank `rank`'s local elements [start, start + length)
        as runs contiguous in the full tensor."""
        run, end, i = self.run_length, start + length, start
        while i < end:
            k, j = divmod(i, run)
            n = min(run - j, end - i)
            yield i - start, (k * self.size + rank) * run + j, n
            i += n

    def owners(self, full_start: int, length: int) -> Iterator[tuple[int, int, int, int]]:
        """(offset in the range, TP rank, local start, n): who holds full elements [full_start, +length)."""
        run, end, f = self.run_length, full_start + length, full_start
        while f < end:
            q, j = divmod(f, run)
            n = min(run - j, end - f)
            yield f - full_start, q % self.size, (q // self.size) * run + j, n
            f += n


class Segment(NamedTuple):
    """Output elements [dst, dst + length) are saved TP rank `rank`'s local elements [src, src + length)."""

    rank: int
    src: int
    dst: int
    length: int


def plan_fetch(saved: Cut, target: Cut, rank: int, start: int, length: int) -> list[Segment]:
    """Where local elements [start, start + length) of TP rank `rank` under `target` lie in a parameter
    written under `saved` (see [Note: full-parameter coordinates]); adjacent segments are merged."""
    if saved.full_shape != target.full_shape:
        raise AssertionError(f"cuts of different parameters: {saved.full_shape} vs {target.full_shape}")
    if length == 0:
        return []
    if saved == target:
        return [Segment(rank, start, 0, length)]
    out: list[Segment] = []
    for dst, full, n in target.full_runs(rank, start, length):
        for off, t, src, m in saved.owners(full, n):
            last = out[-1] if out else None
            if last and last.rank == t and last.src + last.length == src and last.dst + last.length == dst + off:
                out[-1] = last._replace(length=last.length + m)
            else:
                out.append(Segment(t, src, dst + off, m))
    return out


def reads(segments: list[Segment]) -> list[tuple[int, int, int, list[Segment]]]:
    """(rank, start, length, segments): the maximal contiguous ranges of each saved rank to read, and
    the segments each one feeds. Together exactly the planned elements, each once."""
    out: list[tuple[int, int, int, list[Segment]]] = []
    for seg in sorted(segments, key=lambda s: (s.rank, s.src)):
        if out and out[-1][0] == seg.rank and out[-1][1] + out[-1][2] == seg.src:
            rank, lo, n, feeds = out[-1]
            feeds.append(seg)
            out[-1] = (rank, lo, n + seg.length, feeds)
        else:
            out.append((seg.rank, seg.src, seg.length, [seg]))
    return out


def assemble(
    segments: list[Segment], read: Callable[[int, int, int], torch.Tensor], length: int, dtype: torch.dtype
) -> torch.Tensor:
    """The planned elements; `read(rank, start, length)` gives saved flat local elements."""
    if len(segments) == 1 and segments[0].length == length:
        only = segments[0]
        return read(only.rank, only.src, only.length)  # the same cut: no copy
    out = torch.empty(length, dtype=dtype)
    for rank, lo, n, feeds in reads(segments):
        values = read(rank, lo, n)
        for s in feeds:
            out[s.dst : s.dst + s.length] = values[s.src - lo : s.src - lo + s.length]
    return out
