"""DistributedModel: MiCS sharding of an unchanged nn.Module through hooks.

    forward:   pre-forward(unit)  -> unshard ("fwd")          post-forward(unit) -> reshard ("fwd")
    backward:  grad of unit output -> unshard ("bwd")          all unit grads in  -> ReduceScatter, reshard
    end of backward (autograd callback): units not reduced yet -> ReduceScatter (zeros where no grad);
               at the accumulation boundary -> AllReduce main grads over the replication group and
               persistent grads over the rdp group.

The root unit keeps its parameters after a forward that records a graph (its lm_head is the first
thing backward needs; FSDP2 does the same) and frees them when backward ends. See [Note: holders]
in unit.py for how shared parameters stay alive.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from shardpar.collectives import Engine
from shardpar.config import Config
from shardpar.precision import DtypePolicy
from shardpar.runtime.materialize import Materializer, check_nothing_materialised
from shardpar.runtime.persistent import PersistentParams
from shardpar.runtime.reducer import GradReducer, plan_buckets
from shardpar.runtime.schedule import LiveCounter, Scheduler
from shardpar.runtime.state import ShardedState
from shardpar.runtime.state_dict import full_state_dict, load_full_state_dict
from shardpar.runtime.unit import Unit, UnitComm, UnitState
from shardpar.runtime.unit_backward import after_backward_of_call, late_gradient
from shardpar.sharding.layout import flat_layout
from shardpar.sharding.plan import UnitPlan, WrapPolicy, plan_units
from shardpar.topology import Topology

_Registered = dict[int, list[nn.Parameter]]


def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, Mapping):  # HF ModelOutput is an OrderedDict
        return [t for v in obj.values() for t in _tensors(v)]
    return [t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


class DistributedModel(nn.Module):
    """Shards `module` across the sharding group; keeps its parameter names and forward signature."""

    def __init__(
        self,
        module: nn.Module,
        *,
        config: Config,
        topology: Topology,
        engine: Engine,
        backward_passes_per_step: int = 1,
        wrap: WrapPolicy = None,
        registered: _Registered | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        k = backward_passes_per_step
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:  # 1.5 would never reach a window's end
            raise ValueError(f"backward_passes_per_step={k!r} must be an integer >= 1 (backward passes per step)")
        if config.delayed_parameter_initialization:
            check_nothing_materialised(module)
        self.module = module
        self.config = config
        self.topology = topology
        self.engine = engine
        self.backward_passes_per_step = backward_passes_per_step
        self.num_backward = 0  # every backward pass so far (informational)
        self.microbatches_in_step = 1  # set by smp.step while it runs
        # Backward passes of the open accumulation window, and the window's length at its last
        # backward (backward_passes_per_step x micro-batches). Counted, not derived from num_backward:
        # the micro-batch count is known only while smp.step runs, and a resumed run may use another.
        self.window_backwards = 0
        self.window_length = backward_passes_per_step
        self._backward_ends_window = False
        self.loss_scale = 1.0  # set by the DistributedOptimizer's fp16 loss scaler
        self.unused_params: set[int] = set()  # ids of params without a gradient in the last window
        self.policy = DtypePolicy.from_config(config)
        self._finalize_queued_for: int | None = None
        self.device = device or _module_device(module)
        materialize = Materializer(module, self.device)
        materialize.buffers()
        plans = plan_units(module, wrap)
        self.persistent = PersistentParams(
            self._split_persistent(plans),
            engine=engine,
            rdp=topology.rdp,
            compute_dtype=self.policy.compute,
            reduce_dtype=self.policy.reduce,
            device=self.device,
            materialize=materialize,
        )
        self.live = LiveCounter()
        self.units = self._build_units(plans, materialize)
        self.scheduler = Scheduler(self.units, cap=config.sdp_max_live_parameters, live=self.live)
        self.reducer = GradReducer(
            engine,
            topology.sharding,
            topology.replication,
            self.policy.reduce,
            self.device,
            plan_buckets(self.units, config.sdp_reduce_bucket_size),
        )
        self.sharded_state = ShardedState(
            self.units, self.persistent, engine=engine, topology=topology, device=self.device
        )
        self._unit_of_param = {id(p): u for u in self.units for p in u.params}
        self._link_dependencies(plans, registered or {})
        self._install_hooks()

    # ---- construction -------------------------------------------------------------------------

    def _split_persistent(self, plans: list[UnitPlan]) -> list[tuple[str, nn.Parameter]]:
        threshold = self.config.sdp_param_persistence_threshold
        persistent = []
        for up in plans:
            keep = [(n, p) for n, p in up.params if p.numel() < threshold]
            persistent.extend(keep)
            up.params = [(n, p) for n, p in up.params if p.numel() >= threshold]
        return persistent

    def _build_units(self, plans: list[UnitPlan], materialize: Callable[[nn.Parameter], torch.Tensor]) -> list[Unit]:
        node, cross = self.topology.groups["sharding_node"], self.topology.groups["sharding_cross"]
        hierarchical = (
            self.config.sdp_hierarchical_allgather
            and self.topology.plan.spans_nodes
            and node.size > 1
            and cross.size > 1
        )
        comm = UnitComm(
            engine=self.engine,
            sharding=self.topology.sharding,
            replication=self.topology.replication,
            shard_index=self.topology.coords.sdp_rank,
            node=node if hierarchical else None,
            cross=cross if hierarchical else None,
            on_live_change=self.live,
        )
        units: list[Unit] = []
        for up in plans:
            # Units without sharded parameters are kept (they communicate nothing): their hooks still
            # hold the parameters they borrow (smp.register_parameter) and mark the start of backward.
            layout = flat_layout([(n, tuple(p.shape)) for n, p in up.params], comm.sharding.size)
            unit = Unit(
                len(units),
                up.name or "<root>",
                up.module,
                [p for _, p in up.params],
                layout,
                comm,
                policy=self.policy,
                device=self.device,
            )
            unit.take_shards_from_params(materialize)
            units.append(unit)
        return units

    def _link_dependencies(self, plans: list[UnitPlan], registered: _Registered) -> None:
        by_module = {id(u.module): u for u in self.units}
        for up in plans:
            user = by_module.get(id(up.module))
            borrowed = list(up.borrowed) + [p for m in up.module.modules() for p in registered.get(id(m), [])]
            for p in borrowed:
                owner = self._unit_of_param.get(id(p))
                if owner is None or user is None or owner is user or owner in user.deps:
                    continue
                user.deps.append(owner)

    def _install_hooks(self) -> None:
        self._handles = []
        for unit in self.units:
            self._handles.append(unit.module.register_forward_pre_hook(self._make_pre_forward(unit)))
            self._handles.append(unit.module.register_forward_hook(self._make_post_forward(unit)))
            for p in unit.params:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad_accumulated))
        for p in self.persistent.params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad_accumulated))
        self._handles.append(self.module.register_forward_pre_hook(self._root_pre_forward))

    # ---- hooks --------------------------------------------------------------------------------

    def _make_pre_forward(self, unit: Unit) -> Any:
        def hook(module: nn.Module, args: Any) -> Any:
            # During backward this is an activation-checkpoint recomputation: the unit belongs to
            # its backward until its grads are reduced.
            backward = _in_backward()
            self.scheduler.require(unit, "bwd" if backward else "fwd", backward=backward)
            if unit.deps and not backward and torch.is_grad_enabled():
                return after_backward_of_call(unit, args)
            return None

        return hook

    def _make_post_forward(self, unit: Unit) -> Any:
        is_root = unit.module is self.module

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            records_graph = torch.is_grad_enabled()
            if records_graph:
                self._register_pre_backward(unit, output)
            if not (is_root and records_graph):
                unit.reshard("fwd")
            if is_root and not _in_backward():
                self.scheduler.end_forward()
            return None

        return hook

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if not _in_backward():
            if self._finalize_queued_for is not None:
                # A backward that raised never ran its end callback; a new forward starts clean,
                # without the .grad it left on parameters it had not reduced yet.
                self._finalize_queued_for = None
                for unit in self.units:
                    unit.drop_stale_grads()
                self.persistent.drop_stale_grads()
            self.scheduler.begin_forward()

    def _register_pre_backward(self, unit: Unit, output: Any) -> None:
        def on_grad(grad: torch.Tensor) -> None:
            self._queue_finalize()
            if not unit.reduced:
                self.scheduler.require(unit, "bwd", backward=True)

        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(on_grad)

    def _on_grad_accumulated(self, p: torch.Tensor) -> None:
        self._queue_finalize()
        unit = self._unit_of_param.get(id(p))
        if unit is None:
            return  # persistent: reduced at the boundary
        if unit.reduced:
            raise late_gradient(unit, p)
        unit.grads_arrived += 1
        if unit.grads_arrived == unit.num_trainable and not unit.has_frozen:
            self.reducer.add(unit)
            unit.reshard("bwd")
            unit.reshard("fwd")

    def _queue_finalize(self) -> None:
        # Queue once per outermost backward: a reentrant activation checkpoint runs nested backward
        # graph tasks whose end is not the end of the step's backward.
        if self._finalize_queued_for is not None:
            return
        self._finalize_queued_for = torch._C._current_graph_task_id()
        for unit in self.units:
            unit.begin_backward()
        self.window_length = self.backward_passes_per_step * self.microbatches_in_step
        self._backward_ends_window = self.window_backwards + 1 >= self.window_length
        self.reducer.begin_backward(boundary=self._backward_ends_window, scale=1.0 / self.microbatches_in_step)
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        self._finalize_queued_for = None
        for unit in self.units:
            if unit.num_trainable and not unit.reduced:
                self.reducer.add(unit)
        # See [Note: micro-batch averaging].
        scale = 1.0 / self.microbatches_in_step
        self.reducer.drain(scale=scale)
        self.persistent.collect_grads(scale=scale)
        self.num_backward += 1
        self.window_backwards = 0 if self._backward_ends_window else self.window_backwards + 1
        if self._backward_ends_window:
            if not self.reducer.replicates:  # else the buckets carried it ([Note: replication in the bucket])
                for unit in self.units:
                    unit.finish_accumulation()
            self._agree_on_unused_params()
        for unit in self.units:
            unit.release()
        self.scheduler.end_backward()

    def _agree_on_unused_params(self) -> None:
        """[Note: unused params]
        A parameter that got no gradient anywhere in the accumulation window must not be stepped:
        plain PyTorch leaves its .grad None, so SGD momentum and AdamW weight decay skip it. Shards
        only see zeros, so the ranks agree on per-parameter "got a gradient" flags -- folded into
        the persistent-gradient AllReduce over the rdp group, no extra collective."""
        holders: list[Unit | PersistentParams] = [*self.units, self.persistent]
        flags = [float(b) for h in holders for b in h.grad_used]
        agreed = self.persistent.finish_accumulation(torch.tensor(flags, device=self.device)).tolist()
        params = [p for h in holders for p in h.params]
        self.unused_params = {id(p) for p, seen in zip(params, agreed, strict=True) if seen == 0.0}

    def reset_grad_usage(self) -> None:
        self.sharded_state.reset_grad_usage()

    def end_step(self) -> None:
        """Called by the optimizer after each step: closes the step in the communication records, and
        releases what a graph-recording forward that got no backward (a metric computed without
        torch.no_grad) left gathered -- the root keeps its parameters for the backward -- since those
        values are stale now; the next forward gathers the stepped ones."""
        for unit in self.units:
            unit.borrow_calls = 0  # calls from graphs that never got a backward
            unit.release()
        stats = getattr(self.engine, "stats", None)
        if stats is not None:
            stats.begin_step()

    def comm_stats(self, step: int = -1) -> dict[tuple[str, str], dict[str, int]]:
        """Calls and bytes per (collective, group kind) of a completed optimizer step (default: the
        last one), e.g. {("all_gather", "sharding"): {"calls": 7, "bytes": 3552}, ...}."""
        stats = getattr(self.engine, "stats", None)
        if stats is None or not stats.history:
            return {}
        summary: dict[tuple[str, str], dict[str, int]] = stats.summarize(stats.history[step])
        return summary

    def set_prefetch_depth(self, depth: int) -> None:
        """How many units ahead to gather (default 1; 0 turns prefetching off)."""
        if depth < 0:
            raise ValueError(f"prefetch depth {depth} must be >= 0")
        self.scheduler.prefetch_depth = depth

    def set_live_trace(self, enabled: bool) -> None:
        """Record (unit, delta, live elements) at every gather and free, in `model.live.trace`."""
        self.live.trace = [] if enabled else None

    # ---- nn.Module surface --------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, scaled by the fp16 loss scale (the optimizer divides it out again).

        [Note: micro-batch averaging]
        Under `smp.step` with `microbatches=n`, every micro-batch's gradient enters the fp32 main grad
        multiplied by 1/n (`GradReducer.drain` and `PersistentParams.collect_grads`, as part of the
        add that accumulates it), so `model.backward(loss)` and a plain `loss.backward()` both give
        the average over micro-batches -- one backward on the whole batch. Scaling each contribution
        rather than the whole main grad at the boundary leaves alone what is already there (grads of
        an earlier step when `zero_grad` is not called between steps, as plain PyTorch allows), and
        it costs nothing: it is the `alpha` of the add. It happens before `optimizer.step()` computes
        the clip norm and the fp16 overflow check. `backward_passes_per_step` still sums: the user
        divides the loss, as with plain PyTorch accumulation.
        """
        (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # Not self._modules["module"]: before __init__ sets it, or after `del model.module`, a
            # KeyError would escape hasattr().
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            return getattr(module, name)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def state_dict(  # type: ignore[override]
        self, *args: Any, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """Full tensors under the unwrapped model's keys (gathered unit by unit), each after `prefix`;
        written into `destination` when given, as nn.Module does when this model is another's child.
        With `keep_vars` buffers are the module's own tensors; parameters are full fp32 copies
        whatever `keep_vars` says (a sharded parameter has no full tensor to hand out)."""
        if len(args) > 3:
            raise TypeError(f"state_dict() takes at most 3 positional arguments ({len(args)} given)")
        # nn.Module's deprecated positional form: (destination, prefix, keep_vars)
        destination = args[0] if len(args) > 0 else destination
        prefix = args[1] if len(args) > 1 else prefix
        keep_vars = args[2] if len(args) > 2 else keep_vars
        full = full_state_dict(self.sharded_state, self.module, keep_vars=keep_vars)
        if destination is None and not prefix:
            return full
        out: dict[str, Any] = OrderedDict() if destination is None else destination
        for key, value in full.items():
            out[prefix + key] = value
        metadata = getattr(out, "_metadata", None)
        if metadata is not None:  # a parent's state_dict: the versions its load_state_dict reads
            metadata.update(getattr(self.module.state_dict(prefix=prefix, keep_vars=True), "_metadata", {}))
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load full tensors (as returned by `state_dict`) into the shards and persistent params; a
        missing key (strict) or a tensor of another shape raises before anything is written.

        `assign=True` raises ValueError: the parameters are views of their unit's shards, so the
        values are always copied in, never adopted."""
        if assign:
            raise ValueError(
                "load_state_dict(assign=True) is not supported by a DistributedModel: its parameters are "
                "views of the sharded fp32 main copy, so the values are copied in, not adopted; pass assign=False"
            )
        return load_full_state_dict(self.sharded_state, self.module, state_dict, strict)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every sharded parameter (1-D) and every persistent parameter."""
        return self.sharded_state.local_state_dict()

    def live_elements(self) -> int:
        """Unsharded elements alive right now."""
        return sum(u.num_live_elements for u in self.units)

    def all_sharded(self) -> bool:
        return all(u.state is UnitState.SHARDED for u in self.units)


def _module_device(module: nn.Module) -> torch.device:
    for t in module.parameters():
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")
