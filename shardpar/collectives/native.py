"""NativeEngine: collectives over torch.distributed (NCCL on CUDA, gloo on CPU).

Raw torch.distributed collective calls live here and in topology.py (docs/design.md section 9).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from shardpar.collectives.base import (
    CompletedWork,
    FutureWork,
    Group,
    ReduceOp,
    Span,
    Work,
    check_gather_shapes,
    pack_spans,
)
from shardpar.collectives.failures import CollectiveError, CollectiveTimeoutError, FailureBoard, culprit_message
from shardpar.collectives.native_work import AllOf, EventWork, NativeWork

# [Note: gloo's gather temporary]
# gloo's AllGather gathers into a flat temporary as large as its whole output and copies the blocks
# out of it, whatever the output already is (ProcessGroupGloo; measured: +1 output of peak RSS per
# call). For a unit of several hundred MB that transient is as large as the unit itself, outside the
# live cap (issue 19). Above GLOO_GATHER_CHUNK_BYTES the gather is issued as a sequence of list-form
# AllGathers, each of a column range of every rank's block -- the same bytes in the same places --
# so the temporary is one chunk (gloo allocates it when the work runs on its thread, so at most one
# per worker thread is alive, measured 2 x 30 MiB for a 381 MiB output). A gloo call costs ~1 ms
# fixed; a 309 MB gather at 4 ranks took as long in 32 MiB chunks as in one call, within this
# machine's noise (4 repeats each, 2.2-6.7 s against 3.5-8.0 s under load).
# The chunk is 4 MiB, not 32: the temporaries (two chunks) must stay small against a unit, not as large
# as one. With 32 MiB chunks a WideNet block of 33.6 MB (its two 2048 x 2048 weights and, since only
# trained parameters persist, its biases) staged through a whole 32 MiB chunk: its gather's RSS peak was
# two blocks (tests/multiproc/test_frozen.py, 67 MB against 37-51 MB in 4 MiB chunks; issue 33).
GLOO_GATHER_CHUNK_BYTES = 4 << 20

# [Note: ReduceScatter by exchange]
# gloo's ReduceScatter is an AllReduce of the whole input: each rank sends (and receives) twice what a
# ReduceScatter must move, 2 (n-1)/n of the input instead of (n-1)/n (measured across a veth link between
# two network namespaces: 100.1 MB on the wire for a 100 MB input at 2 ranks; its AllToAll, 50.06 MB).
# On the groups whose traffic crosses nodes -- the cross-node hop of a hierarchical ReduceScatter
# ("sharding_cross") -- the native engine does it as an AllToAll (block j of every rank's input goes to
# rank j) and sums the n received blocks itself, in rank order: the minimum bytes, and the same sum on
# every rank whatever order the blocks arrived in. It costs one input-sized receive buffer, as gloo's own
# AllReduce-based path does. NCCL's ReduceScatter is already a ring of (n-1)/n; CUDA keeps it.
EXCHANGE_KINDS = frozenset({"sharding_cross"})


def _gather_in_chunks(output: torch.Tensor, input: torch.Tensor, group: Group) -> AllOf:
    """AllGather `input` into `output` in chunks of at most GLOO_GATHER_CHUNK_BYTES of output."""
    n, k = group.size, input.numel()
    blocks = output.view(n, k)
    step = max(1, GLOO_GATHER_CHUNK_BYTES // (n * input.element_size()))
    works = [
        dist.all_gather(
            [blocks[r, a : a + step] for r in range(n)], input[a : a + step], group=group.handle, async_op=True
        )
        for a in range(0, k, step)
    ]
    return AllOf(works)


class NativeEngine:
    """The torch.distributed engine. `timeout_s` bounds every wait: a dead peer becomes an error."""

    name = "native"

    def __init__(self, *, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s
        self._chain: ThreadPoolExecutor | None = None  # made at the first CPU all_gather_after
        self._side_stream: Any = None  # made at the first CUDA all_gather_after
        self._board: FailureBoard | None = None
        self.board()  # posts this rank's pid now, so survivors can tell it died ([Note: first failure])

    def board(self) -> FailureBoard | None:
        """The job's failure board in the default group's store; None without torch.distributed."""
        if self._board is None and dist.is_available() and dist.is_initialized():
            try:
                store = dist.distributed_c10d._get_default_store()
            except Exception:  # no store to share (a private torch API: fail soft)
                return None
            self._board = FailureBoard(store, dist.get_rank())
        return self._board

    def _run(
        self, group: Group, launch: Any, async_op: bool, finish: Any = None, *, on: torch.Tensor, op: str = "collective"
    ) -> Work:
        """Launch the collective `op` on the tensor `on`; a CUDA one is waited for on the device."""
        if group.handle is None:
            raise AssertionError(f"this rank is not a member of {group.kind} group {group.ranks}")

        def explain(error: BaseException, waited: float, allowed: float) -> BaseException:
            return self._explain(error, op, group, waited=waited, allowed=allowed)

        work = NativeWork(launch(), timeout_s=self.timeout_s, finish=finish, on_device=on.is_cuda, explain=explain)
        if not async_op:
            work.wait()
            return CompletedWork()
        return work

    def _explain(self, error: BaseException, op: str, group: Group, *, waited: float, allowed: float) -> BaseException:
        """A gloo / NCCL failure, with the rank that failed first ([Note: first failure]): gloo's own
        message names at best an address ("Connection closed by peer [127.0.0.1]:41234")."""
        text = str(error)
        timed_out = waited >= 0.95 * allowed or "timeout" in text.lower() or "timed out" in text.lower()
        what = f"native {op} on {group.kind} group {list(group.ranks)}"
        local = f"{what} failed after {waited:.3g} s of waiting (timeout {allowed:g} s): {text.strip()}"
        message, culprit = culprit_message(self.board(), local, ranks=group.ranks, culprit=None, timed_out=timed_out)
        return (CollectiveTimeoutError if timed_out else CollectiveError)(message, culprit)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: Group, *, async_op: bool = False) -> Work:
        check_gather_shapes(output, input, group, "all_gather")
        if group.size == 1:
            output.copy_(input)
            return CompletedWork()
        if not output.is_cuda and output.numel() * output.element_size() > GLOO_GATHER_CHUNK_BYTES:
            return self._run(
                group, lambda: _gather_in_chunks(output, input, group), async_op, on=output, op="all_gather"
            )
        return self._run(
            group,
            lambda: dist.all_gather_single(output, input, group=group.handle, async_op=True),
            async_op,
            on=output,
            op="all_gather",
        )

    def all_gather_mesh(
        self, output: torch.Tensor, input: torch.Tensor, group: Group, *, async_op: bool = False
    ) -> Work:
        """AllGather as a one-hop mesh (reference 000: SMDDP's inter-node mesh): every rank sends its
        block straight to each peer and receives theirs, instead of forwarding blocks around a ring
        (n-1 hops). Same result, bit for bit, as `all_gather`."""
        check_gather_shapes(output, input, group, "all_gather")
        me = dist.get_rank()
        blocks = output.view(group.size, input.numel())
        blocks[group.rank_of(me)].copy_(input)
        if group.size == 1:
            return CompletedWork()
        ops = []
        for index, peer in enumerate(group.ranks):
            if peer != me:
                ops.append(dist.P2POp(dist.isend, input, peer, group=group.handle))
                ops.append(dist.P2POp(dist.irecv, blocks[index], peer, group=group.handle))
        return self._run(group, lambda: AllOf(dist.batch_isend_irecv(ops)), async_op, on=output, op="all_gather mesh")

    def close(self) -> None:
        """Stop the chain thread after what it has queued (local; no collective)."""
        if self._chain is not None:
            self._chain.shutdown(wait=True, cancel_futures=False)
            self._chain = None

    def all_gather_after(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: Group,
        *,
        after: Work,
        then: Callable[[], None] | None = None,
    ) -> Work:
        """`all_gather` once `after` completed, then `then`, without the caller waiting
        ([Note: hierarchical chaining] in hierarchical.py). On CPU the steps run on one chain thread
        in issue order, so every rank issues its chained gathers alike; on CUDA they are queued on a
        side stream that waits for the caller's stream, off the compute stream."""
        check_gather_shapes(output, input, group, "all_gather")
        if output.is_cuda:
            return self._chain_on_stream(output, input, group, after, then)

        def step() -> None:
            after.wait()
            self.all_gather(output, input, group)
            if then is not None:
                then()

        if self._chain is None:
            self._chain = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardpar-chain")
        return FutureWork(self._chain.submit(step), self.timeout_s, "chained all_gather", group, engine="native")

    def _chain_on_stream(
        self, output: torch.Tensor, input: torch.Tensor, group: Group, after: Work, then: Callable[[], None] | None
    ) -> Work:
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=output.device)
        stream = self._side_stream
        stream.wait_stream(torch.cuda.current_stream(output.device))
        with torch.cuda.stream(stream):
            after.wait()  # device-side: the side stream waits for the first step
            self.all_gather(output, input, group, async_op=True).wait()
            if then is not None:
                then()
            event = torch.cuda.Event()
            event.record(stream)
        # Made on the caller's stream, used on the side stream: not reused before the side stream is done.
        output.record_stream(stream)
        input.record_stream(stream)
        return EventWork(event, self.timeout_s, output.device)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: Group,
        *,
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
    ) -> Work:
        check_gather_shapes(output, input, group, "reduce_scatter")
        if group.size == 1:
            output.copy_(input)
            return CompletedWork()
        if group.kind in EXCHANGE_KINDS and not input.is_cuda:
            return self._reduce_scatter_by_exchange(output, input, group, op=op, async_op=async_op)
        torch_op, finish = self._reduce_op(op, output, group)
        return self._run(
            group,
            lambda: dist.reduce_scatter_single(output, input, op=torch_op, group=group.handle, async_op=True),
            async_op,
            finish,
            on=output,
            op="reduce_scatter",
        )

    def _reduce_scatter_by_exchange(
        self, output: torch.Tensor, input: torch.Tensor, group: Group, *, op: ReduceOp, async_op: bool
    ) -> Work:
        """[Note: ReduceScatter by exchange]: block j of every rank's input to rank j (AllToAll), then
        the received blocks summed here, in rank order."""
        n, k = group.size, output.numel()
        received = torch.empty_like(input)

        def finish() -> None:
            torch.sum(received.view(n, k), dim=0, out=output)
            if op is ReduceOp.AVG:
                output.div_(n)

        return self._all_to_all(received, input, group, async_op, finish, op="reduce_scatter")

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, group: Group, *, async_op: bool = False) -> Work:
        if output.numel() != input.numel() or input.numel() % group.size:
            raise ValueError(
                f"all_to_all: input {input.numel()} and output {output.numel()} elements must be equal and a "
                f"multiple of the group size {group.size}"
            )
        if group.size == 1:
            output.copy_(input)
            return CompletedWork()
        return self._all_to_all(output, input, group, async_op, None, op="all_to_all")

    def _all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool, finish: Any, *, op: str
    ) -> Work:
        return self._run(
            group,
            lambda: dist.all_to_all_single(output, input.contiguous(), group=group.handle, async_op=True),
            async_op,
            finish,
            on=output,
            op=op,
        )

    def reduce_scatter_spans(
        self,
        output: torch.Tensor,
        spans: Sequence[Span],
        group: Group,
        *,
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
    ) -> Work:
        return self.reduce_scatter(output, pack_spans(output, spans, group), group, op=op, async_op=async_op)

    def reads_spans(self, output: torch.Tensor, group: Group) -> bool:
        return False

    def all_reduce(
        self, tensor: torch.Tensor, group: Group, *, op: ReduceOp = ReduceOp.SUM, async_op: bool = False
    ) -> Work:
        if group.size == 1:
            return CompletedWork()
        dense, back = _dense(tensor)
        torch_op, finish = self._reduce_op(op, dense, group)
        return self._run(
            group,
            lambda: dist.all_reduce(dense, op=torch_op, group=group.handle, async_op=True),
            async_op,
            _then(finish, back),
            on=tensor,
            op="all_reduce",
        )

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group, *, async_op: bool = False) -> Work:
        if src not in group.ranks:
            raise ValueError(f"broadcast: src rank {src} is not in {group.kind} group {group.ranks}")
        if group.size == 1:
            return CompletedWork()
        dense, back = _dense(tensor)
        return self._run(
            group,
            lambda: dist.broadcast(dense, src=src, group=group.handle, async_op=True),
            async_op,
            back,
            on=tensor,
            op="broadcast",
        )

    def barrier(self, group: Group) -> None:
        if group.size == 1:
            return
        # A tiny all_reduce instead of dist.barrier: it honours our timeout on every backend and
        # needs no device guess for NCCL.
        flag = torch.zeros(1, device=self._device(group))
        self.all_reduce(flag, group)

    def alloc_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def _reduce_op(self, op: ReduceOp, tensor: torch.Tensor, group: Group) -> tuple[Any, Any]:
        if op is ReduceOp.SUM:
            return dist.ReduceOp.SUM, None
        if tensor.is_cuda:
            return dist.ReduceOp.AVG, None
        # gloo has no AVG: sum, then divide in place once the data arrived.
        size = group.size
        return dist.ReduceOp.SUM, lambda: tensor.div_(size)

    @staticmethod
    def _device(group: Group) -> torch.device:
        backend = dist.get_backend(group.handle)
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _dense(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """`tensor`, or a dense copy and the step that copies the result back: gloo reads and writes a
    strided tensor as if it were dense (a column of a matrix came back as the wrong elements)."""
    if tensor.is_contiguous():
        return tensor, None
    dense = tensor.contiguous()
    return dense, lambda: tensor.copy_(dense)


def _then(first: Any, second: Any) -> Any:
    if first is None or second is None:
        return first or second
    return lambda: (first(), second())


def broadcast_object(obj: Any, src: int, group: Group) -> Any:
    """Send a picklable Python object from global rank `src` to every rank of `group`."""
    if group.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group.handle)
    return box[0]


def all_gather_object(obj: Any, group: Group) -> list[Any]:
    """Every rank's `obj`, in group order."""
    if group.size == 1:
        return [obj]
    out: list[Any] = [None] * group.size
    dist.all_gather_object(out, obj, group=group.handle)
    return out
