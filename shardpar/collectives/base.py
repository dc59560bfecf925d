"""The Engine protocol: every collective shardpar issues goes through one of these.

An engine works on flat tensors and explicit groups. Calls return a `Work` handle; with
``async_op=False`` the handle is already complete when the call returns. Byte accounting is done by
`shardpar.collectives.stats.CountingEngine`, which wraps any engine.

Shapes (n = group.size):

    all_gather:      input [k]        -> output [n*k]   (block i of output is rank i's input)
    reduce_scatter:  input [n*k]      -> output [k]     (rank i gets the reduced block i)
    reduce_scatter_spans: the same, input given as spans end to end (tensors, or counts of zeros)
    all_reduce:      tensor [k]       -> tensor [k]     (in place)
    all_to_all:      input [n*k]      -> output [n*k]   (block j of input to rank j; block i of output from rank i)
    broadcast:       tensor [k]       -> tensor [k]     (in place, from global rank `src`)
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"


@dataclass(frozen=True)
class Group:
    """A set of global ranks that communicate together, plus the backend object that serves it.

    `kind` is a glossary word ("sharding", "replication", "tp", ...) used by the byte accounting;
    `handle` is whatever the engine needs (a torch ProcessGroup for the native engine), or None when
    this rank is not a member.
    """

    kind: str
    ranks: tuple[int, ...]
    handle: Any = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_of(self, global_rank: int) -> int:
        """Position of `global_rank` inside this group."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise AssertionError(f"rank {global_rank} is not in {self.kind} group {self.ranks}") from None


# A span of a ReduceScatter input: a 1-D contiguous tensor, or an int k standing for k zeros.
Span = torch.Tensor | int


@runtime_checkable
class Work(Protocol):
    def wait(self, timeout: float | None = None) -> None:
        """Block until the collective finished; raise on failure or after `timeout` seconds."""
        ...

    def is_completed(self) -> bool: ...


class CompletedWork:
    """The handle of a collective that already finished (synchronous calls, groups of one)."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


@runtime_checkable
class Engine(Protocol):
    """What the runtime needs from a collective backend."""

    name: str

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: Group, *, async_op: bool = False
    ) -> Work: ...

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: Group,
        *,
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
    ) -> Work: ...

    def reduce_scatter_spans(
        self,
        output: torch.Tensor,
        spans: Sequence[Span],
        group: Group,
        *,
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
    ) -> Work:
        """reduce_scatter of the spans laid end to end; the spans must stay unchanged until it is done."""
        ...

    def reads_spans(self, output: torch.Tensor, group: Group) -> bool:
        """Whether reduce_scatter_spans reads the spans where they lie. If not, it packs them into one
        buffer first, and a caller that can pack as the spans arrive should do so itself."""
        ...

    def all_reduce(
        self, tensor: torch.Tensor, group: Group, *, op: ReduceOp = ReduceOp.SUM, async_op: bool = False
    ) -> Work: ...

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group, *, async_op: bool = False) -> Work: ...

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, group: Group, *, async_op: bool = False) -> Work:
        """Block j of `input` [n*k] to group member j; block i of `output` [n*k] from member i."""
        ...

    def barrier(self, group: Group) -> None: ...

    def alloc_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A communication buffer owned by the engine (shared memory, registered memory, ...)."""
        ...


class _DeferredGather:
    """`all_gather_after` for an engine that cannot chain: the gather runs inside `wait`."""

    def __init__(self, run: Callable[[float | None], None]) -> None:
        self._run: Callable[[float | None], None] | None = run
        self._error: BaseException | None = None

    def wait(self, timeout: float | None = None) -> None:
        if self._error is not None:  # a second wait after a failure fails again, never "done"
            raise self._error
        run, self._run = self._run, None
        if run is not None:
            try:
                run(timeout)
            except BaseException as exc:
                self._error = exc
                raise

    def is_completed(self) -> bool:
        return self._run is None and self._error is None


def all_gather_after(
    engine: Engine,
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group,
    *,
    after: Work,
    then: Callable[[], None] | None = None,
) -> Work:
    """AllGather `input` once `after` has completed (it writes `input`), then call `then`: started
    without the caller waiting where the engine can chain (an `all_gather_after` method: the smddp
    worker, the native engine's chain thread or side stream), otherwise run inside `wait`. The
    chained steps of one engine run in issue order, so every rank issues them alike."""
    chain = getattr(engine, "all_gather_after", None)
    if chain is not None:
        return chain(output, input, group, after=after, then=then)

    def run(timeout: float | None) -> None:
        after.wait(timeout)
        engine.all_gather(output, input, group)
        if then is not None:
            then()

    return _DeferredGather(run)


def check_gather_shapes(output: torch.Tensor, input: torch.Tensor, group: Group, op: str) -> None:
    """Validate the flat-tensor contract shared by all_gather and reduce_scatter."""
    big, small = (output, input) if op == "all_gather" else (input, output)
    if big.numel() != small.numel() * group.size:
        raise ValueError(
            f"{op}: the large tensor has {big.numel()} elements but must have "
            f"group size {group.size} x {small.numel()} = {group.size * small.numel()}"
        )
    if big.dtype != small.dtype:
        raise ValueError(f"{op}: dtypes differ ({input.dtype} in, {output.dtype} out); use one dtype")
    if not (big.is_contiguous() and small.is_contiguous()):
        raise ValueError(f"{op}: tensors must be contiguous; call .contiguous() first")


def check_spans(output: torch.Tensor, spans: Sequence[Span], group: Group) -> int:
    """Validate a reduce_scatter_spans call on the caller, before any rank enters it; returns the
    number of input elements."""
    total = 0
    for i, span in enumerate(spans):
        if isinstance(span, int):
            if span < 0:
                raise ValueError(f"reduce_scatter_spans: span {i} asks for {span} zeros; a count must be >= 0")
            total += span
            continue
        if span.dtype != output.dtype or span.device != output.device or not span.is_contiguous():
            raise ValueError(
                f"reduce_scatter_spans: spans[{i}] ({span.dtype} on {span.device}, contiguous="
                f"{span.is_contiguous()}) must be contiguous and match output ({output.dtype} on {output.device})"
            )
        total += span.numel()
    if total != group.size * output.numel():
        raise ValueError(
            f"reduce_scatter_spans: the spans hold {total} elements but must hold group size "
            f"{group.size} x {output.numel()}; pad with an int span of zeros"
        )
    return total


def pack_spans(output: torch.Tensor, spans: Sequence[Span], group: Group) -> torch.Tensor:
    """The spans, checked (`check_spans`), end to end in one new buffer: the reduce_scatter input of an
    engine that cannot read them in place."""
    buffer = torch.empty(check_spans(output, spans, group), dtype=output.dtype, device=output.device)
    at = 0
    for span in spans:
        if isinstance(span, int):
            buffer[at : at + span].zero_()
            at += span
        else:
            buffer[at : at + span.numel()].copy_(span)
            at += span.numel()
    return buffer


class FutureWork:
    """A step run on an engine's own thread (the smddp worker, the native engine's chain thread);
    `wait` re-raises its error, or TimeoutError.

    By default `wait` allows twice the engine's timeout plus 10 s, counted from the call to `wait`:
    inside the step every shm wait already has the engine's timeout and fails naming the missing
    peer, and that error (raised here) is the useful one. This deadline is the backstop for a
    worker that stopped making progress at all. `explain` turns a failure into the error to raise
    (the engine's: it names the rank that failed first); without it the step's error is raised."""

    def __init__(
        self,
        future: Future[None],
        timeout_s: float,
        op: str = "collective",
        group: Group | None = None,
        explain: Callable[[BaseException, bool], BaseException] | None = None,
        engine: str = "smddp",
    ) -> None:
        self._future, self._timeout_s, self._op, self._group = future, timeout_s, op, group
        self._explain, self._engine = explain, engine

    def wait(self, timeout: float | None = None) -> None:
        seconds = 2 * self._timeout_s + 10 if timeout is None else timeout
        # Not future.result(timeout): its TimeoutError is the builtin one (Python >= 3.11), which the
        # step's own ShmTimeoutError subclasses, so catching it would hide the transport's message.
        done, _ = futures.wait([self._future], timeout=seconds)
        if not done:
            where = f" on {self._group.kind} group {list(self._group.ranks)}" if self._group is not None else ""
            stuck = TimeoutError(
                f"{self._engine} {self._op}{where} did not finish within {seconds:g} s of waiting for it "
                f"(collective_timeout_s={self._timeout_s:g}); look for an earlier error on another rank, or raise "
                "collective_timeout_s if the ranks are only slow"
            )
            if self._explain is None:
                raise stuck
            raise self._explain(stuck, True)
        error = self._future.exception()
        if error is None:
            return
        if self._explain is None:
            raise error
        explained = self._explain(error, False)
        if explained is error:
            raise error
        raise explained from error

    def is_completed(self) -> bool:
        return self._future.done()
