"""Communication accounting: a CountingEngine wraps any engine and records every call.

Bytes counted per call (the tensor the caller hands over, whatever the algorithm moves on the wire):

    all_gather      output bytes (the gathered tensor)     reduce_scatter   input bytes
    all_reduce      tensor bytes                           broadcast        tensor bytes

Records are grouped into steps: `begin_step()` closes the current step, so a test can pin the exact
schedule of one training step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shardpar.collectives.base import Engine, Group, ReduceOp, Span, Work, all_gather_after


@dataclass(frozen=True)
class CommRecord:
    op: str
    group: str
    group_size: int
    bytes: int
    dtype: torch.dtype
    async_op: bool
    engine: str = ""


class CommStats:
    """Per-step lists of `CommRecord`s."""

    def __init__(self) -> None:
        self.current: list[CommRecord] = []
        self.history: list[list[CommRecord]] = []

    def record(self, rec: CommRecord) -> None:
        self.current.append(rec)

    def begin_step(self) -> list[CommRecord]:
        """Close the running step (if it recorded anything) and return its records."""
        done = self.current
        if done:
            self.history.append(done)
        self.current = []
        return done

    def reset(self) -> None:
        self.current, self.history = [], []

    @staticmethod
    def summarize(records: list[CommRecord]) -> dict[tuple[str, str], dict[str, int]]:
        """{(op, group): {"calls": n, "bytes": b}}."""
        calls: Counter[tuple[str, str]] = Counter()
        nbytes: Counter[tuple[str, str]] = Counter()
        for r in records:
            calls[(r.op, r.group)] += 1
            nbytes[(r.op, r.group)] += r.bytes
        return {k: {"calls": calls[k], "bytes": nbytes[k]} for k in calls}

    def bytes_by_op(self, records: list[CommRecord] | None = None) -> dict[str, int]:
        out: Counter[str] = Counter()
        for r in self.current if records is None else records:
            out[r.op] += r.bytes
        return dict(out)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CountingEngine:
    """Records op, group kind, bytes and calls of every collective, then delegates."""

    def __init__(self, inner: Engine, stats: CommStats | None = None) -> None:
        self.inner = inner
        self.stats = stats or CommStats()
        self.name = inner.name

    def _rec(
        self,
        op: str,
        group: Group,
        t: torch.Tensor,
        async_op: bool,
        routed: torch.Tensor | None = None,
        nbytes: int | None = None,
    ) -> None:
        """Record one call of `nbytes` (default: t's); `routed` is the tensor an engine with per-call
        routing decides on (the AllGather input), so a fallback shows as engine "native-fallback"."""
        engine = self.inner.name
        route = getattr(self.inner, "route", None)
        if route is not None and str(route(op, t if routed is None else routed, group)).startswith("native:"):
            engine = "native-fallback"
        size = _nbytes(t) if nbytes is None else nbytes
        self.stats.record(CommRecord(op, group.kind, group.size, size, t.dtype, async_op, engine))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: Group, *, async_op: bool = False) -> Work:
        self._rec("all_gather", group, output, async_op, routed=input)
        return self.inner.all_gather(output, input, group, async_op=async_op)

    def all_gather_after(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: Group,
        *,
        after: Work,
        then: Callable[[], None] | None = None,
    ) -> Work:
        """Recorded when issued (as an async all_gather), whenever the inner engine runs it."""
        self._rec("all_gather", group, output, True, routed=input)
        return all_gather_after(self.inner, output, input, group, after=after, then=then)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: Group,
        *,
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
    ) -> Work:
        self._rec("reduce_scatter", group, input, async_op)
        return self.inner.reduce_scatter(output, input, group, op=op, async_op=async_op)

    def reduce_scatter_spans(
        self,
        output: torch.Tensor,
        spans: Sequence[Span],
        group: Group,
        *,
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
    ) -> Work:
        self._rec("reduce_scatter", group, output, async_op, nbytes=group.size * _nbytes(output))
        return self.inner.reduce_scatter_spans(output, spans, group, op=op, async_op=async_op)

    def reads_spans(self, output: torch.Tensor, group: Group) -> bool:
        return self.inner.reads_spans(output, group)

    def all_reduce(
        self, tensor: torch.Tensor, group: Group, *, op: ReduceOp = ReduceOp.SUM, async_op: bool = False
    ) -> Work:
        self._rec("all_reduce", group, tensor, async_op)
        return self.inner.all_reduce(tensor, group, op=op, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group, *, async_op: bool = False) -> Work:
        self._rec("broadcast", group, tensor, async_op)
        return self.inner.broadcast(tensor, src, group, async_op=async_op)

    def barrier(self, group: Group) -> None:
        self.inner.barrier(group)

    def alloc_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.alloc_buffer(numel, dtype, device)
