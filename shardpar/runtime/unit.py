"""One unit's life cycle: its shards, `unshard` / `reshard`, and `reduce_grads` / `finish_accumulation`.

A unit owns the sharded parameters of one module (a transformer block, or the root for the rest).
Between `unshard` and `reshard` each original parameter's `.data` is a view into the unit's gathered
buffer; otherwise it is an empty tensor and only the flat fp32 main shard holds the values.

[Note: holders]
A unit stays unsharded while any *hold* on it is left. A `Hold` names why it is needed: its own
forward (`FORWARD`), its own backward (`BACKWARD`: from the pre-backward hook or an activation-checkpoint
recomputation until its grads are reduced), a `PREFETCH` issued by the scheduler, or the same kinds
*borrowed*, `Hold(kind, borrower=i)`, when unit i uses one of its parameters (tied weights,
smp.register_parameter). A unit's own hold puts `Hold(kind, borrower=its index)` on each unit it
borrows from; a borrowed hold is passed on unchanged to the lender's own lenders. `reshard` drops one
hold and frees the buffer when none is left, so a parameter is never freed under a user that still
needs it. Only the Scheduler (schedule.py) takes and drops holds; the hooks (hooks.py) ask it.

A borrower's BACKWARD hold is not dropped when the borrower's own grads arrive -- they may come before
the backward of an op that saved the borrowed parameter (`x @ w`) -- but once the gradients of the
tensor inputs of each of its forward calls have been computed, which is when its whole backward has
run (`release_borrowed`, from hooks.py's _CallBackwardDone through the scheduler); a call without such
inputs leaves it to the end of the backward.

[Note: gathered storage]
At sdp > 1 a unit has ONE gathered buffer for its whole life, `_gathered` (padded_numel elements in
compute dtype), whose storage is emptied when the unit is resharded and refilled when it is unsharded
(FSDP2's `free_storage` / `alloc_storage`, _fsdp_param.py):

    unshard:  storage.resize_(padded_numel * itemsize) ; AllGather into _gathered ; p.data = views of it
    reshard:  p.data = empty tensor ; storage.resize_(0)          <- the memory goes back here

Why the storage and not the tensor: autograd keeps what a forward saved until the backward runs --
F.linear saves the weight for the input gradient as a transposed *view*, a tensor of its own that
shares the buffer's storage object. Dropping our tensor (`_full = None`, as until issue 19) left those
views holding every unit's gathered memory from its forward to its backward, whatever
sdp_max_live_parameters said. `resize_(0)` frees the memory under every view at once, whoever holds
them (autograd, hooks, caches). A view addresses storage + offset when it is read, so once backward
unshards the unit again -- the same storage object, refilled by a new AllGather -- every view autograd
saved reads the re-gathered values: the same bits, since parameters do not change between a forward
and its backward. The scheduler gathers a unit before any of its backward nodes runs (the pre-backward
hook, an activation-checkpoint recomputation, or a borrower's hold, [Note: holders]). A saved view read
while its unit is sharded finds a storage without memory: torch does not check that, the process dies
(SIGSEGV on CPU) -- loud, never stale values; before issue 19 it silently read the old buffer.

Saved views stay *valid* too: autograd checks a saved tensor's version counter at unpack. Each
original parameter keeps its own version counter across `p.data = ...` (set_data does not share the
new data's), and the views autograd saves are made from the parameter, so they share the parameter's
counter, not the buffer's. Writes into `_gathered` -- the engine's AllGather, the hierarchical gather's
permute copy, `load_full_params` through `p.data` -- bump only the buffer's own counter, so no
`_unsafe_preserve_version_counter` is needed (FSDP2 copies into the parameters' own views, so it needs
one). At sdp 1 the parameters view the compute shard itself (no gather): there is nothing to free.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardpar.collectives import Work
from shardpar.precision import DtypePolicy
from shardpar.runtime.frozen import FrozenShard
from shardpar.runtime.holds import Hold, HoldKind, UnitState
from shardpar.runtime.replica_shard import WHOLE_SHARD, ReplicaShard, WholeShard
from shardpar.runtime.unit_comm import UnitComm
from shardpar.runtime.unit_grads import UnitGrads
from shardpar.sharding.layout import FlatLayout, ParamSlice


def set_param_data(p: nn.Parameter, data: torch.Tensor) -> None:
    """`p.data = data`, also when `p` is still a meta tensor (delayed initialization): meta and real
    tensors have incompatible implementations for `.data`, so the first assignment swaps the whole
    tensor in place -- the Parameter object (and every reference to it) stays the same."""
    if p.is_meta and not data.is_meta:
        torch.utils.swap_tensors(p, nn.Parameter(data, requires_grad=p.requires_grad))
    else:
        p.data = data


class Unit(UnitGrads):
    """One unit's shards, gathered buffer, holds and gradients (the gradient methods: UnitGrads)."""

    def __init__(
        self,
        index: int,
        name: str,
        module: nn.Module,
        params: list[nn.Parameter],
        layout: FlatLayout,
        comm: UnitComm,
        *,
        policy: DtypePolicy,
        device: torch.device,
        frozen: FrozenShard | None = None,
    ) -> None:
        if len(params) != len(layout.specs):
            raise AssertionError(f"unit {name}: {len(params)} params but {len(layout.specs)} specs")
        self.index = index
        self.name = name
        self.module = module
        self.params = params
        self.layout = layout
        self.comm = comm
        self.policy = policy
        self.compute_dtype = policy.compute
        self.device = device
        self.slices: tuple[ParamSlice, ...] = layout.slices(comm.shard_index)
        self._row_slices: list[tuple[ParamSlice, ...]] | None = None  # every shard's, for grad_spans
        self.main_shard = torch.zeros(layout.shard_numel, dtype=torch.float32, device=device)
        self.main_grad: torch.Tensor | None = None
        self._compute_shard: torch.Tensor | None = None  # half-precision copy of main_shard (mixed only)
        self.state = UnitState.SHARDED
        self.holds: set[Hold] = set()
        # The hold this unit's own hold of each kind puts on the units it borrows from.
        self.lent_holds = {kind: Hold(kind, borrower=index) for kind in HoldKind}
        self.deps: list[Unit] = []  # units whose parameters this unit's forward uses
        # Tokens of the graph-recording calls of this unit whose inputs have not all got their gradient
        # yet, and whose graph is still alive ([Note: holders]; [Note: frozen units' backward] in hooks.py).
        self.open_calls: set[int] = set()
        self._full: torch.Tensor | None = None  # what the parameters view while unsharded
        self._gathered: torch.Tensor | None = None  # sdp > 1: [Note: gathered storage]
        self._gather_work: Work | None = None
        # sdp_node_secondary_shard: the cross-node blocks of this step's first gather ([Note: secondary
        # shard], hierarchical.py); None until then and after the unit's values change.
        self._secondary: torch.Tensor | None = None
        # The parameters frozen at wrap time, apart from `params` / `layout` ([Note: frozen shards], frozen.py).
        self.frozen = frozen
        self.num_trainable = sum(p.requires_grad for p in params)
        self.has_frozen = frozen is not None or self.num_trainable != len(params)
        self.grads_arrived = 0
        self.reduced = False  # in the running backward
        # Which parameters got a gradient in this accumulation window (see [Note: unused params]).
        self.grad_used = [False] * len(params)
        # What the optimizer steps of the unit ([Note: the replica strategy], replica_shard.py): the whole
        # shard, or with shard_optimizer_state this rank's piece of it, set by the model once the shard is
        # taken ([Note: replica-sharded main]). Under bf16/fp16 main_shard is then empty: the piece's fp32
        # values are the only ones kept.
        self.replicas: WholeShard | ReplicaShard = WHOLE_SHARD

    # ---- initial sharding --------------------------------------------------------------------

    def take_shards_from_params(
        self, materialize: Callable[[nn.Parameter], torch.Tensor], *, every_param: bool = False
    ) -> None:
        """Copy this rank's slice of each parameter into the main shard, then free the parameter.

        `materialize` gives one full parameter at a time (a delayed-initialised one is built here),
        so at most one full parameter lives beside the shards. It is asked only for the parameters
        this rank holds a slice of, or for every one in order with `every_param` (a collective
        source: [Note: rank 0's initial values], initial_values.py).
        """
        with torch.no_grad():
            for p, sl in zip(self.params, self.slices, strict=True):
                if sl.length or every_param:
                    full = materialize(p)
                    if sl.length:
                        self.main_shard[sl.local].copy_(full.reshape(-1)[sl.param])
                    del full
                set_param_data(p, self._empty(p))
        if self.frozen is not None:
            self.frozen.take_shards(materialize, self._no_data)
        self.refresh_compute()

    def _no_data(self) -> torch.Tensor:
        return torch.empty(0, dtype=self.compute_dtype, device=self.device)

    @property
    def replica(self) -> ReplicaShard | None:
        """This rank's replica piece, or None when the whole shard is stepped (for inspection)."""
        return self.replicas if isinstance(self.replicas, ReplicaShard) else None

    @property
    def gathered_numel(self) -> int:
        """Elements the unit's gathered buffers hold: its trainable layout's and its frozen shard's."""
        return self.layout.padded_numel + (0 if self.frozen is None else self.frozen.padded_numel)

    def _empty(self, p: torch.Tensor) -> torch.Tensor:
        return torch.empty(0, dtype=self.compute_dtype, device=self.device)

    def compute_shard(self) -> torch.Tensor:
        """The shard AllGathered by `unshard`, in compute dtype (the main shard itself in fp32)."""
        return self.main_shard if self._compute_shard is None else self._compute_shard

    def refresh_compute(self) -> None:
        """After the optimizer stepped the fp32 main shard: refresh the half-precision copy."""
        self.drop_secondary()
        if self.frozen is not None:
            # a compute copy or codes refreshed after a load; a kept gather released (the step boundary)
            self.frozen.refresh_compute()
            if self.frozen.counted_live and not self.frozen.holds_memory:
                self.frozen.counted_live = False  # keep_gathered's memory went back now
                if self.comm.on_live_change is not None:
                    self.comm.on_live_change(self, -self.frozen.padded_numel)
        # with replica pieces, the AllGather of the stepped pieces over the replication group
        self.replicas.refresh(self)

    def refresh_compute_copy(self) -> None:
        """The compute copy from the whole fp32 main shard (WholeShard.refresh)."""
        if self.compute_dtype == torch.float32:
            return
        if self._compute_shard is None:
            self._compute_shard = self.main_shard.to(self.compute_dtype)
        else:
            self._compute_shard.copy_(self.main_shard)

    # ---- unshard / reshard -------------------------------------------------------------------

    def unshard(self, hold: Hold, *, async_op: bool = False) -> None:
        """Add `hold` (and its hold on each unit it borrows from); AllGather the unit if nobody had it
        gathered. With `async_op` the gather only starts: `wait_for_unshard` (called by the scheduler)
        finishes it."""
        lent = hold if hold.borrower is not None else self.lent_holds[hold.kind]
        for dep in self.deps:
            dep.unshard(lent, async_op=async_op)
        self.holds.add(hold)
        if self.state is UnitState.SHARDED:
            if self.gathered_numel == 0:
                self.state = UnitState.UNSHARDED
                return
            if self.comm.sharding.size == 1:
                # sdp 1: the shard is the whole unit. Compute on views of it instead of gathering a
                # copy (the copy cost ~41 ms a step at 25M parameters, docs/performance-history.md fix 3).
                if self.layout.numel:
                    self._full = self.compute_shard()
                    self._point_params_at(self._full)
                if self.frozen is not None:
                    self.frozen.start_gather()
                    self.frozen.finish_gather()
                self.state = UnitState.UNSHARDED
            else:
                if self.layout.numel:
                    full = self._fill_gathered_storage()
                    self._gather_work = self._gather(full)
                    self._full = full
                if self.frozen is not None:
                    self.frozen.start_gather()
                self.state = UnitState.UNSHARDING
            self._count_live(+1)
        if not async_op:
            self.wait_for_unshard()

    def _gather(self, full: torch.Tensor) -> Work:
        """Start the AllGather of the compute shard into `full`, from the secondary shard when it holds
        this step's values ([Note: secondary shard])."""
        shard = self.compute_shard()
        if not self.comm.keeps_secondary:
            return self.comm.gather(full, shard, async_op=True, unit=self)
        ready = self._secondary is not None
        if self._secondary is None:
            numel = self.comm.secondary_numel(shard.numel())
            self._secondary = torch.empty(numel, dtype=shard.dtype, device=shard.device)
        return self.comm.gather(full, shard, async_op=True, unit=self, blocks=self._secondary, blocks_ready=ready)

    def drop_secondary(self) -> None:
        """The unit's values changed: its secondary shard was gathered from the old ones."""
        self._secondary = None

    @property
    def secondary_numel(self) -> int:
        """Elements of the secondary shard this unit holds now."""
        return 0 if self._secondary is None else self._secondary.numel()

    def wait_for_unshard(self) -> None:
        """Finish a started AllGather and point every original parameter at its full view."""
        for dep in self.deps:
            dep.wait_for_unshard()
        if self.state is not UnitState.UNSHARDING:
            return
        if self.layout.numel:
            if self._gather_work is None or self._full is None:
                raise AssertionError(f"unit {self.name} is unsharding without a gather in flight")
            self._gather_work.wait()
            self._gather_work = None
            self._point_params_at(self._full)
        if self.frozen is not None:
            self.frozen.finish_gather()
        self.state = UnitState.UNSHARDED

    def _fill_gathered_storage(self) -> torch.Tensor:
        """The gathered buffer with its storage allocated, contents undefined ([Note: gathered storage])."""
        buf = self._gathered
        if buf is None:
            buf = self.comm.engine.alloc_buffer(self.layout.padded_numel, self.compute_dtype, self.device)
            if not buf.untyped_storage().resizable():
                raise AssertionError(f"unit {self.name}: the engine's gathered buffer cannot be freed by resize_")
            self._gathered = buf
        else:
            storage, nbytes = buf.untyped_storage(), buf.numel() * buf.element_size()
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)
        return buf

    def _point_params_at(self, full: torch.Tensor) -> None:
        for p, spec in zip(self.params, self.layout.specs, strict=True):
            p.data = full[spec.offset : spec.offset + spec.numel].view(spec.shape)

    def release_borrowed(self) -> None:
        """Drop this unit's backward holds on the units it borrows from (see [Note: holders])."""
        lent = self.lent_holds[HoldKind.BACKWARD]
        for dep in self.deps:
            if lent in dep.holds:
                dep.reshard(lent)

    def release(self) -> None:
        """Drop every hold and free the gathered buffer (the end of a backward, or of a step)."""
        self.holds.clear()
        self._free_if_unheld()

    def reshard(self, hold: Hold) -> None:
        """Drop `hold`; free the gathered buffer once nothing holds the unit."""
        if hold in self.holds:
            self.holds.discard(hold)
            if hold.borrower is not None or hold.kind is not HoldKind.BACKWARD:
                # (its own backward's hold on its lenders goes in release_borrowed, [Note: holders])
                lent = hold if hold.borrower is not None else self.lent_holds[hold.kind]
                for dep in self.deps:
                    dep.reshard(lent)
        self._free_if_unheld()

    def _free_if_unheld(self) -> None:
        if self.holds or self.state is UnitState.SHARDED:
            return
        if self._gather_work is not None:
            self._gather_work.wait()  # the engine may still be writing into the buffer
            self._gather_work = None
        for p in self.params:
            p.data = self._empty(p)
        if self.frozen is not None:
            self.frozen.free(self._no_data)
        self._count_live(-1)
        if self._full is not None and self._full is self._gathered:
            # the memory itself, under every view autograd saved ([Note: gathered storage])
            self._gathered.untyped_storage().resize_(0)
        self._full = None
        self.state = UnitState.SHARDED

    def _count_live(self, sign: int) -> None:
        """Report the unit's gathered elements to the live count as it is gathered (+1) or freed (-1).
        A frozen shard kept gathered (keep_gathered) stays counted from its first gather of a step to
        its release at the step boundary (refresh_compute): its memory is alive all that time."""
        numel = self.layout.padded_numel
        if self.frozen is not None:
            counted = sign > 0 or self.frozen.holds_memory
            if counted != self.frozen.counted_live:
                numel += self.frozen.padded_numel
                self.frozen.counted_live = counted
        if numel and self.comm.on_live_change is not None:
            self.comm.on_live_change(self, sign * numel)

    @property
    def num_live_elements(self) -> int:
        if self.state is UnitState.SHARDED:
            return 0 if self.frozen is None or not self.frozen.counted_live else self.frozen.padded_numel
        return self.gathered_numel

    # ---- gradients (the rest: unit_grads.py) ---------------------------------------------------

    def finish_accumulation(self) -> None:
        """At the accumulation boundary: average the main grad over the replication group (with replica
        pieces, a ReduceScatter to this rank's piece instead)."""
        self.replicas.finish_accumulation(self)
