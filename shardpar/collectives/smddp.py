"""SmddpEngine: topology-aware collectives over the shared-memory transport, native for the rest.

Routing, decided per call (docs/design.md section 9, reference 003 for the two buffer knobs):

    group on one node, CPU tensors, shm dtype   -> ShmComm of that group (shardpar/collectives/shm.py)
    all_gather over a group spanning nodes      -> hierarchical (collectives/hierarchical.py): native
                                                   cross-node mesh among same-local-position peers,
                                                   then shm inside the node; native ("hierarchical_off")
                                                   when sdp_hierarchical_allgather is off
    AllGather input > SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES               -> native ("scratch")
    SMDDP_AG_SORT_BUFFER_SIZE_BYTES < group size * input / 8 (spanning) -> native ("sort")
    anything else (CUDA, float64 reductions, uneven node split, ...)   -> native, counted by reason

Every fallback is counted in `engine.fallbacks` (a Counter keyed by (op, reason)); `engine.routes`
counts every call by (op, route) so a test can pin where the bytes went.

# [Note: smddp ordering]
# Every async shm step runs on ONE worker thread per engine, in issue order (the C calls release the
# GIL), so all ranks see the same sequence on every communicator; a synchronous call runs on the
# caller when nothing is queued (the order is the same, without the thread hand-off). Native steps are
# issued on the calling thread at call time, exactly like NativeEngine, so their order relative to any other
# torch.distributed call of the program is unchanged. The shm half of a hierarchical gather is queued
# on the worker when the gather is issued and waits there for its native half (`all_gather_after`).
#
# Communicators are created lazily by the worker at the first shm call on a rank set: that call is
# itself collective over the set, so every member reaches the creation at the same point of its
# sequence. Segment names are `shardpar-j<HMAC-SHA256(secret, rank set)>-smddp`: the 128-bit `secret`
# is drawn by rank 0 (`secrets.token_hex`) and sent over the world process group when the engine is
# built (engine construction is collective); it never appears in /dev/shm, and a name seen there
# tells nothing about the other groups' names ([Note: shm trust] in shm_transport.c).
#
# Failures name the rank that failed first ([Note: first failure], failures.py): a step's error
# (the transport's, naming a peer) is posted to the job's store and re-raised, as its cause, under
# a message that adds the first failure any rank posted.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from shardpar.collectives import shm
from shardpar.collectives.base import (
    CompletedWork,
    FutureWork,
    Group,
    ReduceOp,
    Span,
    Work,
    check_gather_shapes,
    check_spans,
    pack_spans,
)
from shardpar.collectives.failures import CollectiveError, CollectiveTimeoutError, culprit_message
from shardpar.collectives.hierarchical import HierarchicalSteps, hierarchical_all_gather
from shardpar.collectives.native import NativeEngine
from shardpar.collectives.smddp_job import _agree_on_job, _split_by_node, segment_key
from shardpar.collectives.smddp_work import SmddpOptions

_REDUCIBLE = (torch.float32, torch.bfloat16, torch.float16)


def _shm_op(op: ReduceOp) -> str:
    return "avg" if op is ReduceOp.AVG else "sum"


class SmddpEngine:
    """Shared-memory collectives inside a node, hierarchical AllGather across nodes, native otherwise."""

    name = "smddp"

    def __init__(self, *, options: SmddpOptions | None = None, native: NativeEngine | None = None) -> None:
        ok, why = shm.available()
        if not ok:
            raise RuntimeError(f"smddp engine: shm transport unavailable: {why}")
        opts = options or SmddpOptions()
        self.native = native or NativeEngine(timeout_s=opts.timeout_s)
        dist_up = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if dist_up else 0
        self.world = dist.get_world_size() if dist_up else 1
        self.options = opts.resolved(self.world)
        self._secret = _agree_on_job(dist_up and self.world > 1, self.rank, self.world, self.ranks_per_node)
        self.fallbacks: Counter[tuple[str, str]] = Counter()
        self.routes: Counter[tuple[str, str]] = Counter()
        self._comms: dict[tuple[int, ...], shm.ShmComm] = {}
        self._worker_ident: int | None = None  # the worker thread's, set as it starts
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smddp", initializer=self._mark_worker)
        self._last: Future[None] | None = None

    # ---- routing ---------------------------------------------------------------------------------

    @property
    def ranks_per_node(self) -> int:
        return self.options.ranks_per_node or self.world

    def _one_node(self, group: Group) -> bool:
        rpn = self.ranks_per_node
        return len({r // rpn for r in group.ranks}) == 1

    def route(self, op: str, tensor: torch.Tensor, group: Group) -> str:
        """ "shm", "hierarchical", "local" (group of one) or "native:<reason>" for this call."""
        if group.size == 1:
            return "local"
        if tensor.device.type != "cpu":
            return "native:device"
        if op in ("reduce_scatter", "all_reduce") and tensor.dtype not in _REDUCIBLE:
            return "native:dtype"
        if op in ("all_reduce", "broadcast") and not tensor.is_contiguous():
            return "native:layout"  # the native engine stages a strided tensor through a dense copy
        if op == "all_gather":
            return self._gather_route(tensor, group)
        return "shm" if self._one_node(group) else "native:spans_nodes"

    def _gather_route(self, input: torch.Tensor, group: Group) -> str:
        nbytes = input.numel() * input.element_size()
        if nbytes > (self.options.ag_scratch_bytes or 0):
            return "native:scratch"
        if self._one_node(group):
            return "shm"
        if not self.options.hierarchical_allgather:
            return "native:hierarchical_off"
        if (self.options.ag_sort_bytes or 0) * 8 < group.size * nbytes:
            return "native:sort"
        return "hierarchical" if _split_by_node(group.ranks, self.ranks_per_node) else "native:uneven_nodes"

    def _count(self, op: str, route: str) -> str:
        self.routes[(op, route)] += 1
        if route.startswith("native:"):
            self.fallbacks[(op, route.removeprefix("native:"))] += 1
        return route

    # ---- the worker ------------------------------------------------------------------------------

    def _submit(self, fn: Callable[[], None], async_op: bool, op: str, group: Group) -> Work:
        """Run `fn` (the collective `op` on `group`, named in its errors)."""

        def explain(error: BaseException, timed_out: bool) -> BaseException:
            return self._explain(error, op, group, timed_out=timed_out)

        if not async_op and (self._last is None or self._last.done()):
            # Nothing queued (FIFO, one worker): run on the caller and skip the thread hand-off.
            try:
                fn()
            except Exception as error:
                explained = explain(error, False)
                if explained is error:
                    raise
                raise explained from error
            return CompletedWork()
        self._last = self._worker.submit(fn)
        work = FutureWork(self._last, self.options.timeout_s, op, group, explain)
        if async_op:
            return work
        work.wait()
        return CompletedWork()

    def _explain(self, error: BaseException, op: str, group: Group, *, timed_out: bool) -> BaseException:
        """The error to raise for a failed step: a transport or backstop failure names the rank that
        failed first ([Note: first failure]); other errors (bad arguments, already explained native
        steps) are raised as they are."""
        board = self.native.board()
        if isinstance(error, CollectiveError) or board is None:
            return error
        if isinstance(error, shm.ShmError) and error.culprit is None:
            board.post(self.rank, str(error))  # this rank's own failure (a foreign segment, a system call)
            return error
        if not isinstance(error, shm.ShmError) and not (timed_out and isinstance(error, TimeoutError)):
            return error
        culprit = error.culprit if isinstance(error, shm.ShmError) else None
        timed_out = timed_out or isinstance(error, shm.ShmTimeoutError)
        what = f"smddp {op} on {group.kind} group {list(group.ranks)}"
        local = f"{what}: {error}"
        message, first = culprit_message(board, local, ranks=group.ranks, culprit=culprit, timed_out=timed_out)
        if isinstance(error, shm.ShmError):
            return type(error)(message, first)  # the same class: callers catching ShmPeerError still do
        return CollectiveTimeoutError(message, first)

    def _mark_worker(self) -> None:
        self._worker_ident = threading.get_ident()

    def _comm(self, ranks: tuple[int, ...]) -> shm.ShmComm:
        """The communicator of `ranks`, called in issue order (see [Note: smddp ordering]) on the
        thread that runs the collective. On the worker the collective overlaps this rank's compute,
        so its waits sleep instead of spinning (`ShmComm.set_patient`; docs/performance-history.md item 8). A
        synchronous call queued behind async ones runs there too, patient, while the caller waits."""
        comm = self._comms.get(ranks)
        if comm is None:
            comm = shm.ShmComm(
                segment_key(self._secret, ranks),
                "smddp",
                ranks.index(self.rank),
                len(ranks),
                timeout_s=self.options.timeout_s,
                members=ranks,
            )
            self._comms[ranks] = comm
        comm.set_patient(threading.get_ident() == self._worker_ident)
        return comm

    # ---- the Engine protocol ---------------------------------------------------------------------

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: Group, *, async_op: bool = False) -> Work:
        check_gather_shapes(output, input, group, "all_gather")
        route = self._count("all_gather", self.route("all_gather", input, group))
        if route == "local":
            output.copy_(input)
            return CompletedWork()
        if route == "shm":
            return self._submit(
                lambda: self._comm(group.ranks).all_gather(output, input), async_op, "all_gather", group
            )
        if route == "hierarchical":
            return self._hierarchical_gather(output, input, group, async_op)
        return self.native.all_gather(output, input, group, async_op=async_op)

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
        route = self._count("reduce_scatter", self.route("reduce_scatter", input, group))
        if route == "local":
            output.copy_(input)
            return CompletedWork()
        if route == "shm":
            return self._submit(
                lambda: self._comm(group.ranks).reduce_scatter(output, input, _shm_op(op)),
                async_op,
                "reduce_scatter",
                group,
            )
        return self.native.reduce_scatter(output, input, group, op=op, async_op=async_op)

    def reduce_scatter_spans(
        self,
        output: torch.Tensor,
        spans: Sequence[Span],
        group: Group,
        *,
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
    ) -> Work:
        """Inside a node the transport reads the spans in place ([Note: shm spans]); elsewhere they
        are packed into one buffer and reduced as `reduce_scatter` would."""
        if self.route("reduce_scatter", output, group) != "shm":
            return self.reduce_scatter(output, pack_spans(output, spans, group), group, op=op, async_op=async_op)
        check_spans(output, spans, group)
        self._count("reduce_scatter", "shm")
        comm_op = _shm_op(op)
        return self._submit(
            lambda: self._comm(group.ranks).reduce_scatter_spans(output, spans, comm_op),
            async_op,
            "reduce_scatter",
            group,
        )

    def reads_spans(self, output: torch.Tensor, group: Group) -> bool:
        return self.route("reduce_scatter", output, group) == "shm"

    def all_reduce(
        self, tensor: torch.Tensor, group: Group, *, op: ReduceOp = ReduceOp.SUM, async_op: bool = False
    ) -> Work:
        """Inside a node this is the balanced-fusion AllReduce of reference 001: the transport splits
        the buffer into n equal parts, rank i reduces part i, then every part is redistributed."""
        route = self._count("all_reduce", self.route("all_reduce", tensor, group))
        if route == "local":
            return CompletedWork()
        if route == "shm":
            return self._submit(
                lambda: self._comm(group.ranks).all_reduce(tensor, _shm_op(op)), async_op, "all_reduce", group
            )
        return self.native.all_reduce(tensor, group, op=op, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group, *, async_op: bool = False) -> Work:
        if src not in group.ranks:
            raise ValueError(f"broadcast: src rank {src} is not in {group.kind} group {group.ranks}")
        route = self._count("broadcast", self.route("broadcast", tensor, group))
        if route == "local":
            return CompletedWork()
        if route == "shm":
            index = group.rank_of(src)
            return self._submit(lambda: self._comm(group.ranks).broadcast(tensor, index), async_op, "broadcast", group)
        return self.native.broadcast(tensor, src, group, async_op=async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, group: Group, *, async_op: bool = False) -> Work:
        """Native: only cross-node hops use it ([Note: cross-node quantization])."""
        self.routes[("all_to_all", "native")] += 1  # its route, not a fallback: no shm AllToAll exists
        return self.native.all_to_all(output, input, group, async_op=async_op)

    def barrier(self, group: Group) -> None:
        if group.size == 1:
            return
        if self._one_node(group):
            self._submit(lambda: self._comm(group.ranks).barrier(), False, "barrier", group)
            return
        self.native.barrier(group)

    def alloc_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def close(self) -> None:
        """Finish queued work, then unmap every segment (local; no collective)."""
        self._worker.shutdown(wait=True)
        self.native.close()
        for comm in self._comms.values():
            comm.close()
        self._comms.clear()

    # ---- hierarchical AllGather ------------------------------------------------------------------

    def all_gather_after(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: Group,
        *,
        after: Work,
        then: Callable[[], None] | None = None,
    ) -> Work:
        """`all_gather` once `after` completed, then `then`, queued on the worker now (in issue order,
        [Note: smddp ordering]) so it runs without the caller waiting; native routes chain there."""
        check_gather_shapes(output, input, group, "all_gather")
        route = self._count("all_gather", self.route("all_gather", input, group))
        if route not in ("shm", "local"):
            return self.native.all_gather_after(output, input, group, after=after, then=then)

        def step() -> None:
            after.wait()
            if route == "local":
                output.copy_(input)
            else:
                self._comm(group.ranks).all_gather(output, input)
            if then is not None:
                then()

        return self._submit(step, True, "all_gather", group)

    def _hierarchical_gather(self, output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool) -> Work:
        """collectives/hierarchical.py's algorithm, with a one-hop mesh across nodes and the shm
        transport inside the node (its node step, queued on the worker behind the mesh)."""
        split = _split_by_node(group.ranks, self.ranks_per_node)
        if split is None:
            raise AssertionError(f"hierarchical gather over uneven group {group.ranks}")
        node_ranks = next(g for g in split[0] if self.rank in g)
        cross_ranks = next(g for g in split[1] if self.rank in g)
        # Point-to-point over the group's own process group: no sub-group to create, and each shard
        # goes straight to its peers on the other nodes (one hop, reference 000's mesh).
        cross = Group(f"{group.kind}_cross", cross_ranks, group.handle)
        node = Group(f"{group.kind}_node", node_ranks)

        def node_step(staged: torch.Tensor, blocks: torch.Tensor, after: Work, then: Callable[[], None]) -> Work:
            def step() -> None:
                after.wait()
                self._comm(node_ranks).all_gather(staged, blocks)
                then()

            return self._submit(step, True, "hierarchical all_gather", group)

        steps = HierarchicalSteps(
            cross=lambda blocks, shard: self.native.all_gather_mesh(blocks, shard, cross, async_op=True),
            node=node_step,
        )
        return hierarchical_all_gather(
            self, output, input, sharding=group, node=node, cross=cross, async_op=async_op, steps=steps
        )


# Importing this module makes `init_process_group(backend="smddp")` work (reference 000: SMDDP is the
# backend of DDP, FSDP and DeepSpeed); see shardpar/collectives/torch_backend.py.
from shardpar.collectives.torch_backend import register as _register_torch_backend  # noqa: E402

_register_torch_backend()
