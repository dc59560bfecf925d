"""`smddp` as a torch.distributed backend: unchanged DDP / FSDP2 / DeepSpeed scripts run on it with
`init_process_group(backend="smddp")` once `shardpar.collectives.smddp` has been imported.

Reference 000/003: SMDDP is used as the process-group backend of PyTorch DDP, FSDP and DeepSpeed.
Here the backend serves the four collectives those frameworks spend their time in from the
shared-memory transport (shardpar/collectives/shm.py), and hands everything else to gloo (CPU) or
NCCL (CUDA), which it registers inside itself:

    allreduce([t])                  one CPU tensor, fp32/bf16/fp16, SUM/AVG   -> shm balanced fusion
    all_gather_single(out, inp)     CPU, contiguous, any dtype                 -> shm
    reduce_scatter_single(out, inp) CPU, fp32/bf16/fp16, SUM/AVG               -> shm
    broadcast([t])                  one contiguous CPU tensor                  -> shm
    anything else, or a group whose members are not all on this host           -> gloo / NCCL

# [Note: python process group]
# torch 2.13 accepts a Python subclass of `ProcessGroup` from a backend creator and uses it in place of
# the group it would have built; C++ callers (DDP's reducer, FSDP2's collectives) reach the Python
# overrides through pybind's trampoline. What shm does not serve goes to the gloo/NCCL backend object
# registered for the tensor's device (see [Note: delegate to the backend]). Subclassing the C++
# `Backend` from Python is not possible ("No constructor defined!"), and functional collectives /
# `_coalescing_manager` bypass Python overrides and go to the registered gloo/NCCL backend (still
# correct, just not through shm).
#
# Shm calls run on one worker thread per group, in issue order, and return a `Work` built from a
# torch Future: the caller overlaps them with compute exactly as with NCCL. Every wait inside the
# transport is bounded by the group's timeout, and a dead peer raises, so the Future always completes.
#
# The segment's name carries a 128-bit secret that rank 0 draws and broadcasts over the group's own
# gloo backend when the group is built: not through the store, which any local user who reaches its
# port can read, and never through /dev/shm ([Note: shm trust] in shm_transport.c). A failed shm call
# names the rank that failed first, read from the job's store ([Note: first failure], failures.py).
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    BroadcastOptions,
    ReduceScatterOptions,
)
from torch._C._distributed_c10d import ProcessGroup as _CProcessGroup

from shardpar.collectives import shm
from shardpar.collectives.failures import FailureBoard, culprit_message

BACKEND_NAME = "smddp"
_REDUCIBLE = (torch.float32, torch.bfloat16, torch.float16)


class SmddpProcessGroup(dist.ProcessGroup):
    """A process group whose hot collectives go through shared memory (see the module docstring)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stubs list only the store overload
        self._register_fallbacks(store, rank, size, timeout)
        # the transport bounds its waits by at most shm.MAX_TIMEOUT_S (a PG timeout of 14 days made
        # every shm call fail, and, before [Note: failed works], do nothing)
        self.timeout_s = min(timeout.total_seconds(), shm.MAX_TIMEOUT_S)
        # routes[(op, route)] counts every call: route "shm", or "fallback:<reason>".
        self.routes: Counter[tuple[str, str]] = Counter()
        self.why_not_shm = self._why_not_shm(dist.PrefixStore("smddp/", store), rank, size)
        self._comm: shm.ShmComm | None = None
        self._worker: ThreadPoolExecutor | None = None
        # The default group is being built: no global rank yet, and it is the group rank.
        global_rank = dist.get_rank() if dist.is_initialized() else rank
        self._board = FailureBoard(store, global_rank)
        if not self.why_not_shm:
            members = self._global_ranks(dist.PrefixStore("smddp/", store), rank, size, global_rank)
            key = self._agree_on_secret(rank)
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smddp-pg")
            # Attached now, while every member is known to be alive and constructing this group: the
            # segment's name is unlinked once all have attached, so a member that fails later leaks
            # nothing (attached at a first collective, a member failing before it left the name behind).
            self._comm = shm.ShmComm(key, "world", rank, size, timeout_s=self.timeout_s, members=members)

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # ---- construction ----------------------------------------------------------------------------

    def _register_fallbacks(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        self._register_backend(torch.device("cpu"), _CProcessGroup.BackendType.GLOO, gloo)
        self._set_default_backend(_CProcessGroup.BackendType.GLOO)
        if torch.cuda.is_available() and dist.is_nccl_available():
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, options)
            self._register_backend(torch.device("cuda"), _CProcessGroup.BackendType.NCCL, nccl)

    @staticmethod
    def _why_not_shm(store: Any, rank: int, size: int) -> str:
        """Empty when shm serves this group; else why every call goes to gloo/NCCL."""
        ok, why = shm.available()
        if size == 1:
            return why or "group of one"
        # Every rank posts, whether or not it has the transport: one that returned early would leave
        # the others in store.get until the store's timeout.
        store.set(f"host/{rank}", shm.host_id() if ok else f"!{why}")
        posts = [store.get(f"host/{r}").decode() for r in range(size)]  # bounded by the store's timeout
        lacking = [(r, post[1:]) for r, post in enumerate(posts) if post.startswith("!")]
        if lacking:
            return f"rank {lacking[0][0]}: {lacking[0][1]}"
        hosts = set(posts)
        return "" if len(hosts) == 1 else f"members on {len(hosts)} hosts"

    @staticmethod
    def _global_ranks(store: Any, rank: int, size: int, global_rank: int) -> list[int]:
        """Every member's global rank, by group rank: errors name ranks as the launcher's logs do."""
        store.set(f"global/{rank}", str(global_rank))
        return [int(store.get(f"global/{r}")) for r in range(size)]  # bounded by the store's timeout

    def _agree_on_secret(self, rank: int) -> str:
        """Rank 0's secret, broadcast over the group's gloo backend (see the module docstring)."""
        secret = torch.zeros(16, dtype=torch.uint8)
        if rank == 0:
            secret.copy_(torch.frombuffer(bytearray(secrets.token_bytes(16)), dtype=torch.uint8))
        opts = BroadcastOptions()
        opts.rootRank = 0
        self._backend([secret]).broadcast([secret], opts).wait()
        return f"pg{bytes(secret.tolist()).hex()}"

    def _shm(self) -> shm.ShmComm:
        if self._comm is None:
            raise AssertionError("shm route taken without a communicator")
        return self._comm

    # ---- routing ---------------------------------------------------------------------------------

    def _route(self, op: str, *tensors: torch.Tensor, reduce_op: str | None = None) -> str:
        """Count and return this call's route; `reduce_op` is None for gathers, "" if unsupported."""
        route = self._route_of(tensors, reduce_op)
        self.routes[(op, route)] += 1
        return route

    def _route_of(self, tensors: tuple[torch.Tensor, ...], reduce_op: str | None) -> str:
        if self.why_not_shm:
            return "fallback:group"
        if any(t.device.type != "cpu" for t in tensors):
            return "fallback:device"
        if any(not t.is_contiguous() for t in tensors):
            return "fallback:layout"
        if reduce_op is not None:
            if any(t.dtype not in _REDUCIBLE for t in tensors):
                return "fallback:dtype"
            if not reduce_op:
                return "fallback:op"
        return "shm"

    def _backend(self, tensors: Any) -> Any:
        """The gloo / NCCL backend registered for the device of the first tensor in `tensors`."""
        first = _first_tensor(tensors)
        return self._get_backend(first.device if first is not None else torch.device("cpu"))

    def _run(self, fn: Callable[[shm.ShmComm], None], result: Any) -> Any:
        """Queue `fn` on the worker; the returned Work completes (or fails) with it."""
        raw: torch.futures.Future[Any] = torch.futures.Future()

        def task() -> None:
            try:
                fn(self._shm())
            except BaseException as exc:  # handed to whoever waits on the Work
                try:
                    exc = self._explain(exc)
                finally:  # whatever happens, the Work completes
                    raw.set_result(_Failed(exc))
            else:
                raw.set_result(result)

        if self._worker is None:
            raise AssertionError("shm route taken without a worker")
        work = _ShmWork(raw)  # chained before the task can complete raw: its callback sees every outcome
        self._worker.submit(task)
        return work

    def _explain(self, error: BaseException) -> BaseException:
        """A transport failure, re-raised (same class, the original as its cause) with the rank that
        failed first ([Note: first failure]); anything else as it is."""
        if not isinstance(error, shm.ShmError) or isinstance(error, shm.ShmForeignSegmentError):
            return error
        comm = self._shm()
        ranks = comm.members if comm.members is not None else list(range(comm.size))
        timed_out = isinstance(error, shm.ShmTimeoutError)
        message, first = culprit_message(
            self._board, str(error), ranks=ranks, culprit=error.culprit, timed_out=timed_out
        )
        explained = type(error)(message, first)
        explained.__cause__ = error
        return explained

    # ---- the collectives served from shared memory -----------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        opts = opts if opts is not None else AllreduceOptions()
        op = _shm_op(opts.reduceOp)
        if len(tensors) != 1 or self._route("allreduce", *tensors, reduce_op=op) != "shm":
            return self._backend(tensors).allreduce(tensors, opts)
        return self._run(lambda comm: comm.all_reduce(tensors[0], _checked(op)), tensors)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = opts if opts is not None else AllgatherOptions()
        if self._route("all_gather_single", output, input) != "shm":
            return self._backend(output)._allgather_base(output, input, opts)
        return self._run(lambda comm: comm.all_gather(output, input), [output])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = opts if opts is not None else ReduceScatterOptions()
        op = _shm_op(opts.reduceOp)
        if self._route("reduce_scatter_single", output, input, reduce_op=op) != "shm":
            return self._backend(output)._reduce_scatter_base(output, input, opts)
        return self._run(lambda comm: comm.reduce_scatter(output, input, _checked(op)), [output])

    # [Note: coalesced overrides hold no GIL]
    # Functional collectives (DTensor's `full_tensor()`, `_c10d_functional.all_gather_into_tensor`)
    # reach a group through these two C++ methods. When a Python subclass does not override them,
    # torch 2.13's trampoline (PyProcessGroup.hpp) calls the C++ base *with the GIL held*, into gloo's
    # `enqueue`, which waits on gloo's work mutex. A gloo worker that meanwhile drops the last reference
    # to a finished work holds that mutex and needs the GIL to free its tensors: both threads wait for
    # ever (seen as a 90 s gloo send/recv timeout on the peer, ~1 run in 10). Overriding them here sends
    # those calls to shm or to the backend's Python bindings, which release the GIL.
    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return _joined([self.all_gather_single(out, inp, opts) for out, inp in zip(outputs, inputs, strict=True)])

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return _joined([self.reduce_scatter_single(out, inp, opts) for out, inp in zip(outputs, inputs, strict=True)])

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        opts = opts if opts is not None else BroadcastOptions()
        if len(tensors) != 1 or self._route("broadcast", *tensors) != "shm":
            return self._backend(tensors).broadcast(tensors, opts)
        root = opts.rootRank
        return self._run(lambda comm: comm.broadcast(tensors[0], root), tensors)


# [Note: delegate to the backend]
# Collectives the transport does not serve are handed to the registered gloo/NCCL backend object
# directly. Going through the C++ `ProcessGroup` method instead (`super().allreduce(...)`, or not
# overriding the method at all) dead-locks gloo intermittently in torch 2.13 (an fp64 all_reduce loop
# hung within a few iterations with 4 ranks; the same calls on the backend object ran 200 iterations
# clean): the trampoline holds the GIL into gloo, see [Note: coalesced overrides hold no GIL]. So every
# collective the trampoline can route to Python is overridden here.
_DELEGATED = {
    "allreduce_coalesced": "allreduce_coalesced",
    "allgather": "allgather",
    "allgather_coalesced": "allgather_coalesced",
    "all_to_all_single": "alltoall_base",
    "alltoall": "alltoall",
    "barrier": "barrier",
    "gather": "gather",
    "monitored_barrier": "monitored_barrier",
    "recv": "recv",
    "recv_anysource": "recv_anysource",
    "reduce": "reduce",
    "reduce_scatter": "reduce_scatter",
    "scatter": "scatter",
    "send": "send",
}


def _delegate(backend_method: str) -> Callable[..., Any]:
    def method(self: SmddpProcessGroup, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._backend(args), backend_method)(*args, **kwargs)

    method.__name__ = backend_method
    return method


for _name, _backend_method in _DELEGATED.items():
    setattr(SmddpProcessGroup, _name, _delegate(_backend_method))


# [Note: failed works]
# A shm call that failed (a dead peer, a timeout, a mismatched call, a bad argument) must fail its Work
# for both kinds of waiter. torch's `_create_work_from_future` cannot do it: a Python Future's
# set_exception only installs a Python-side unwrap (C++ sees an ordinary value), and the wrapping
# Work's wait() returns True whatever the future holds, so every such error was dropped and the tensor
# left unreduced. Here the worker completes a raw future with the result or a `_Failed` box; Python
# waiters get the transport's own exception from `wait()`, and `get_future()` is the raw future
# chained through `_unwrap`, whose raising callback marks it failed in C++ (DDP's reducer waits there).
class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _unwrap(future: torch.futures.Future[Any]) -> Any:
    value = future.value()
    if isinstance(value, _Failed):
        raise value.exc
    return value


class _ShmWork(dist.Work):
    def __init__(self, raw: torch.futures.Future[Any]) -> None:
        super().__init__()
        self._raw = raw
        self._future = raw.then(_unwrap)

    def wait(self, timeout: Any = None) -> bool:
        value = self._raw.wait()
        if isinstance(value, _Failed):
            raise value.exc  # ShmPeerError, ShmTimeoutError, ...: what the transport said
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return self._raw.done()


class _JoinedWork(dist.Work):
    """Completes when every one of `works` has; fails when any of them failed."""

    def __init__(self, works: list[Any]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: Any = None) -> bool:
        for work in self._works:
            work.wait()
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        every = torch.futures.collect_all([w.get_future() for w in self._works])
        return every.then(lambda done: [f.value() for f in done.value()])  # value() raises if one failed

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


def _joined(works: list[Any]) -> Any:
    """One Work that completes when every one of `works` has (the only one, when there is one)."""
    return works[0] if len(works) == 1 else _JoinedWork(works)


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, list | tuple):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _shm_op(reduce_op: Any) -> str:
    """The transport's name for a torch ReduceOp; "" when the transport cannot do it."""
    if reduce_op == dist.ReduceOp.SUM:
        return "sum"
    if reduce_op == dist.ReduceOp.AVG:
        return "avg"
    return ""


def _checked(op: str) -> str:
    if not op:
        raise AssertionError("shm route taken for a reduction the transport cannot do")
    return op


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> SmddpProcessGroup:
    return SmddpProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Make `backend="smddp"` known to torch.distributed (idempotent)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
