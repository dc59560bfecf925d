"""Communication accounting: a CountingEngine wraps any engine and records every call.

Bytes counted per call (the tensor the caller hands over, whatever the algorithm moves on the wire):

    all_gather      output bytes (the gathered tensor)     reduce_scatter   input bytes
    all_reduce      tensor bytes                           broadcast        tensor bytes
    all_to_all      input bytes

Records are grouped into steps: `begin_step()` closes the current step, so a test can pin the exact
schedule of one training step. Only a window of the last `max_steps` closed steps is kept (the optimizer
closes one per step, so an unbounded list grew ~3 KiB a step on a tiny model, for ever):

    history = deque(maxlen=max_steps)   [step n-max_steps+1] ... [step n]    <- begin_step() appends
    current = [records of the running step]                                   (at most max_records_per_step)
    num_steps = n                        steps closed since the last reset(), kept or not
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shardpar.collectives.base import Engine, Group, ReduceOp, Span, Work, all_gather_after

DEFAULT_MAX_STEPS = 32
DEFAULT_MAX_RECORDS_PER_STEP = 1 << 16


@dataclass(frozen=True, slots=True)  # slots: ~half the bytes of a record with a __dict__
class CommRecord:
    op: str
    group: str
    group_size: int
    bytes: int
    dtype: torch.dtype
    async_op: bool
    engine: str = ""


class CommStats:
    """Per-step lists of `CommRecord`s: the running step and a bounded window of closed ones.

    `max_steps` closed steps are kept in `history` (oldest first; `history[-1]` is the last closed
    step); older ones are dropped. A running step that reaches `max_records_per_step` records (a
    forward-only loop that never steps the optimizer never closes one) is closed as a step of its
    own, so memory stays bounded whoever calls what. `reset()` drops everything.
    """

    def __init__(
        self, *, max_steps: int = DEFAULT_MAX_STEPS, max_records_per_step: int = DEFAULT_MAX_RECORDS_PER_STEP
    ) -> None:
        for name, value in (("max_steps", max_steps), ("max_records_per_step", max_records_per_step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CommStats {name}={value!r} must be an integer >= 1")
        self.max_steps = max_steps
        self.max_records_per_step = max_records_per_step
        self.current: list[CommRecord] = []
        self.history: deque[list[CommRecord]] = deque(maxlen=max_steps)
        self.num_steps = 0  # steps closed since the last reset(), including those the window dropped

    def record(self, rec: CommRecord) -> None:
        if len(self.current) >= self.max_records_per_step:
            self.begin_step()
        self.current.append(rec)

    def begin_step(self) -> list[CommRecord]:
        """Close the running step (if it recorded anything) and return its records."""
        done = self.current
        if done:
            self.history.append(done)
            self.num_steps += 1
        self.current = []
        return done

    def steps_since(self, num_steps: int) -> list[list[CommRecord]]:
        """The records of the steps closed after the first `num_steps` (read `num_steps` before the
        calls to watch); ValueError when some of them already left the window."""
        new = self.num_steps - num_steps
        if new < 0 or new > len(self.history):
            raise ValueError(
                f"steps_since({num_steps}): {self.num_steps} steps were closed and the window keeps the last "
                f"{len(self.history)} (max_steps={self.max_steps}); read num_steps closer to the calls you watch"
            )
        return list(self.history)[len(self.history) - new :]

    def reset(self) -> None:
        """Drop every record (new containers: the old ones' memory is given back)."""
        self.current = []
        self.history = deque(maxlen=self.max_steps)
        self.num_steps = 0

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

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, group: Group, *, async_op: bool = False) -> Work:
        self._rec("all_to_all", group, input, async_op)
        return self.inner.all_to_all(output, input, group, async_op=async_op)

    def barrier(self, group: Group) -> None:
        self.inner.barrier(group)

    def alloc_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.alloc_buffer(numel, dtype, device)
