"""DistributedModel: MiCS sharding of an unchanged nn.Module through hooks.

It builds the pieces and keeps the nn.Module surface: the units (unit.py) with their shards, the
persistent parameters (model_build.py builds the units and picks which parameters persist), the
Scheduler that alone gathers and frees units (schedule.py), the bucketed reducer (reducer.py), the
accumulation window (window.py), and the hooks that drive them (hooks.py, where the forward/backward
sequence is pictured). Three mixins in its bases carry the rest of its surface: state_dict /
load_state_dict (model_state_dict.py), SMP v1's names (model_v1.py) and FSDP2's unshard / reshard
(model_fsdp2.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from shardpar.collectives import Engine
from shardpar.collectives.entry import EntryCheck
from shardpar.config import Config
from shardpar.precision import DtypePolicy
from shardpar.runtime.boundary_cast import call_in_compute_dtype
from shardpar.runtime.buffers import BufferSync
from shardpar.runtime.frozen_modes import refuse_bitsandbytes, settle_frozen_mode
from shardpar.runtime.full_views import FullStateDictHooks, wrap_save_pretrained
from shardpar.runtime.holds import UnitState
from shardpar.runtime.hooks import ModelHooks
from shardpar.runtime.initial_values import InitialValues
from shardpar.runtime.materialize import Materializer, check_nothing_materialised, module_device, refuse_nested
from shardpar.runtime.model_build import Registered, build_units, link_dependencies, split_persistent, two_hop_reduce
from shardpar.runtime.model_fsdp2 import FSDP2Mixin
from shardpar.runtime.model_state_dict import StateDictMixin
from shardpar.runtime.model_v1 import V1Mixin
from shardpar.runtime.persistent import PersistentParams
from shardpar.runtime.reducer import GradReducer, plan_buckets
from shardpar.runtime.replica_shard import replica_comm
from shardpar.runtime.schedule import LiveCounter, Scheduler
from shardpar.runtime.sharded_tensor import ShardComm
from shardpar.runtime.state import ShardedState
from shardpar.runtime.state_dict import TPLayout, persistent_buffers
from shardpar.runtime.user_params import UserParams
from shardpar.runtime.window import AccumulationWindow
from shardpar.sharding.plan import WrapPolicy, plan_units
from shardpar.sharding.tp_split import TPSplit
from shardpar.topology import Topology


class DistributedModel(StateDictMixin, V1Mixin, FSDP2Mixin, nn.Module):
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
        registered: Registered | None = None,
        device: torch.device | None = None,
        premade: Collection[nn.Parameter] = (),
        average_grads_across_microbatches: bool = True,
        find_optimizer: Callable[[], Any] = lambda: None,
        tp_splits: Mapping[str, TPSplit] | None = None,
        broadcast_buffers: bool = True,
        entry: EntryCheck | None = None,
    ) -> None:
        super().__init__()
        self._entry = entry  # [Note: collective entry]: gathering calls check in first (None: never)
        self.window = AccumulationWindow(  # validates backward_passes_per_step first
            backward_passes_per_step, average_microbatches=average_grads_across_microbatches
        )
        self._find_optimizer = find_optimizer  # for post-partition hooks (the facade's optimizer)
        self._post_partition_hooks: OrderedDict[int, Callable[[Any, Any], None]] = OrderedDict()  # weakref-able
        self._post_step_hooks: OrderedDict[int, Callable[[Any, Any], None]] = OrderedDict()
        refuse_nested(module)
        refuse_bitsandbytes(module)
        if config.delayed_parameter_initialization:
            check_nothing_materialised(module, premade=premade)
        self.module = module
        # Not `config`: that name is the wrapped model's own (HF code reads and sets model.config.use_cache;
        # __getattr__ forwards it to the module).
        self.shardpar_config = config
        self.topology = topology
        self.engine = engine
        self.unused_params: set[int] = set()  # ids of params without a gradient in the last window
        self.policy = DtypePolicy.from_config(config)
        self.device = device or module_device(module)
        # Non-finite losses `backward` saw in the open window: a tensor, so the healthy path never syncs;
        # made on first use, so that what wrapping leaves alive is the shards alone.
        self._nonfinite_losses: torch.Tensor | None = None
        materialize = Materializer(module, self.device)
        materialize.buffers()
        plans = plan_units(module, wrap)
        # rank 0's values, unit by unit ([Note: rank 0's initial values])
        values = InitialValues.for_model(module, plans, materialize, topology, engine, tp_splits, self.device)
        persistent, unit_of_persistent = split_persistent(plans, config)
        for i in sorted(set(unit_of_persistent.values())):
            values.take_real(p for _, p in persistent if unit_of_persistent[id(p)] == i)
        self.persistent = PersistentParams(
            persistent,
            engine=engine,
            rdp=topology.rdp,
            compute_dtype=self.policy.compute,
            reduce_dtype=self.policy.reduce,
            device=self.device,
            materialize=values,
        )
        self.live = LiveCounter()
        # shard_optimizer_state ([Note: replica-sharded main], replica_shard.py): each unit's strategy
        # ([Note: the replica strategy]); NoReplicas when off or one replica
        self.replicas = replica_comm(config.shard_optimizer_state, topology, engine)
        self.units = build_units(
            plans,
            values,
            config=config,
            topology=topology,
            engine=engine,
            policy=self.policy,
            device=self.device,
            replicas=self.replicas,
            live=self.live,
        )
        settle_frozen_mode(self.units, config, topology, engine, self.device)  # frozen_modes.py
        self.scheduler = Scheduler(self.units, cap=config.sdp_max_live_parameters, live=self.live)
        self.reducer = GradReducer(
            engine,
            topology.sharding,
            topology.replication,
            self.policy.reduce,
            self.device,
            plan_buckets(self.units, config.sdp_reduce_bucket_size),
            two_hop=two_hop_reduce(config, topology, engine, self.policy, self.device),
        )
        self.sharded_state = ShardedState(
            self.units, self.persistent, engine=engine, topology=topology, device=self.device
        )
        self._unit_of_param = {
            id(p): u for u in self.units for p in [*u.params, *(u.frozen.params if u.frozen else [])]
        }
        link_dependencies(self.units, plans, registered or {}, self._unit_of_param)
        window = self.window
        self.user_params = UserParams(
            module,
            self.sharded_state,
            self.units,
            self.persistent,
            unit_of_persistent=unit_of_persistent,
            comm=ShardComm(
                engine, topology.rdp if self.sharded_state.replica_sharded else topology.sharding, topology.tp
            ),
            tp_splits=tp_splits,
            tp_rank=topology.coords.tp_rank,
            # not `self`: the gradients' layouts reach this through the watch, and a `.grad` is held by
            # C++, out of gc's sight -- capturing the model would keep it alive for ever ([Note: hook cycles])
            loss_scale=lambda: window.loss_scale,
        )
        self._hooks = ModelHooks(
            module,
            self.units,
            self.persistent,
            scheduler=self.scheduler,
            reducer=self.reducer,
            window=self.window,
            unit_of_param=self._unit_of_param,
            unit_of_persistent=unit_of_persistent,
            user_params=self.user_params,
            on_window_end=self._agree_on_unused_params,
            on_backward_end=self._publish_grads,
            on_forward_start=self._on_forward_start,
        )
        self._hooks.install()
        self._tp = TPLayout(tp_splits, engine, topology.tp, topology.tp.rank_of(topology.rank)) if tp_splits else None
        self._full_hooks = FullStateDictHooks(module, self.sharded_state.full_values, self._tp, self.gathering)
        wrap_save_pretrained(
            module,
            is_rank0=topology.rank == 0,
            barrier=lambda: engine.barrier(topology.group("world")),
            gathering=self.gathering,
        )
        self.buffer_sync = BufferSync(
            list(persistent_buffers(module).values()) if broadcast_buffers else [], engine=engine, group=topology.rdp
        )
        self.buffer_sync.sync()
        self._nested_prefix: str | None = None  # set while a parent's load_state_dict passes through
        self.register_load_state_dict_post_hook(DistributedModel._forget_inner_missing)

    def gathering(self, name: str, fix: str) -> AbstractContextManager[None]:
        """Around a call that gathers from every rank: every rank checks in first, so a call made on some
        ranks only raises there, naming `name` and `fix` ([Note: collective entry])."""
        return self._entry.call(name, fix) if self._entry is not None else nullcontext()

    def _agree_on_unused_params(self) -> None:
        """[Note: unused params]
        A parameter that got no gradient anywhere in the accumulation window must not be stepped:
        plain PyTorch leaves its .grad None, so SGD momentum and AdamW weight decay skip it. Shards
        only see zeros, so the ranks agree on per-parameter "got a gradient" flags -- folded into
        the persistent-gradient AllReduce over the rdp group, no extra collective."""
        state = self.sharded_state
        flags = torch.tensor([float(b) for b in state.grad_used()], device=self.device)
        agreed = self.persistent.finish_accumulation(flags).tolist()
        self.unused_params = {id(p.param) for p, seen in zip(state.pieces, agreed, strict=True) if seen == 0.0}

    def _on_forward_start(self) -> None:
        """The root's forward starts: main values a plain optimizer wrote reach the compute copies, and
        the rdp group's first rank's buffers reach every rank of it (runtime/buffers.py)."""
        self.sharded_state.refresh_if_written()
        self.buffer_sync.sync()

    def _publish_grads(self, boundary: bool) -> None:
        """After each backward: the user parameters' .grad view the main grads ([Note: user gradients],
        user_params.py); at the end of a window, None for the parameters no rank got a gradient for."""
        self.user_params.publish_grads(self.unused_params if boundary else ())

    def reset_window(self) -> None:
        """The open window's gradients are dropped (zero_grad): its count, and the node sums a deferred
        cross hop kept ([Note: cross hop at the boundary], two_hop.py)."""
        self.window.reset()
        if self.reducer.two_hop is not None:
            self.reducer.two_hop.drop_partials()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) the gradients of the open window: the main grads behind the user parameters'
        .grad, the window's count of backward passes, what `backward` saw of their losses, and a clip
        of them. The one implementation: `optimizer.zero_grad()` calls it too."""
        self.reset_window()
        self.nonfinite_losses.zero_()
        self.user_params.clip_watch.reset()
        if set_to_none:  # like torch: grads that stay (zeroed) tensors keep being stepped
            self.reset_grad_usage()
            self.user_params.clear_grads()
        self.sharded_state.clear_grads(set_to_none=set_to_none)

    def reset_grad_usage(self) -> None:
        self.sharded_state.reset_grad_usage()

    def end_step(self) -> None:
        """Called by the optimizer after each step: closes the step in the communication records, and
        releases what a graph-recording forward that got no backward (a metric computed without
        torch.no_grad) left gathered -- the root keeps its parameters for the backward -- since those
        values are stale now; the next forward gathers the stepped ones. The window just stepped (or
        skipped) is over: its non-finite losses and a clip of its gradients are forgotten."""
        self.user_params.clip_watch.reset()
        self.nonfinite_losses.zero_()
        self.scheduler.release_all()
        self.user_params.reset()  # after model.unshard() the modules held the (now freed) compute parameters
        stats = getattr(self.engine, "stats", None)
        if stats is not None:
            stats.begin_step()

    def comm_stats(self, step: int = -1) -> dict[tuple[str, str], dict[str, int]]:
        """Calls and bytes per (collective, group kind) of a completed optimizer step (default: the
        last one; -2 the one before), e.g. {("all_gather", "sharding"): {"calls": 7, "bytes": 3552}, ...}.
        Only the last `CommStats.max_steps` steps are kept (collectives/stats.py)."""
        stats = getattr(self.engine, "stats", None)
        if stats is None or not stats.history:
            return {}
        kept = len(stats.history)
        if not -kept <= step < kept:
            raise IndexError(
                f"comm_stats(step={step}): the records keep the last {kept} completed steps "
                f"(CommStats.max_steps={stats.max_steps}); pass -1 .. -{kept} (or 0 .. {kept - 1}, oldest first)"
            )
        summary: dict[tuple[str, str], dict[str, int]] = stats.summarize(stats.history[step])
        return summary

    def set_prefetch_depth(self, depth: int) -> None:
        """How many units ahead to gather (default 1; 0 turns prefetching off)."""
        if depth < 0:
            raise ValueError(f"prefetch depth {depth} must be >= 0")
        self.scheduler.prefetch_depth = depth

    def set_backward_passes_per_step(self, backward_passes_per_step: int) -> None:
        """The accumulation window's backward passes per step, from the next backward on."""
        self.window.set_backward_passes_per_step(backward_passes_per_step)

    def no_sync(self) -> AbstractContextManager[None]:
        """DDP's `no_sync()`: backwards inside accumulate without the replication AllReduce; the first
        backward outside ends the accumulation window ([Note: no_sync] in window.py)."""
        return self.window.no_sync()

    # The window owns these; the properties keep the attributes scripts set and read (a plain setattr
    # on nn.Module would otherwise create a new attribute the window never sees).
    @property
    def backward_passes_per_step(self) -> int:
        return self.window.backward_passes_per_step

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, value: int) -> None:
        self.window.set_backward_passes_per_step(value)

    @property
    def loss_scale(self) -> float:
        """What `backward` multiplies the loss by: the DistributedOptimizer's fp16 loss scale (its loss
        scaler's, read through the window: [Note: one owner of the loss scale] in window.py)."""
        return self.window.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.window.scaler.loss_scale = value  # the owner's value ([Note: one owner of the loss scale])

    @property
    def num_backward(self) -> int:
        """Backward passes so far (read-only)."""
        return self.window.num_backward

    def set_live_trace(self, enabled: bool) -> None:
        """Record (unit, delta, live elements) at every gather and free, in `model.live.trace`."""
        self.live.trace = [] if enabled else None

    # ---- nn.Module surface --------------------------------------------------------------------

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> DistributedModel:
        """`model.to(...)`, `.half()`, `.cuda()`, ...: a no-op where nothing changes; otherwise refused.
        The parameters are views of the fp32 main shards on the device smp.init chose; converting the
        views would leave the shards -- and training -- as they were."""
        for p in self.user_params.user:
            out = fn(p)
            if out.dtype != p.dtype or out.device != p.device:
                raise ValueError(
                    f"{type(self).__name__}: converting parameter {p.shard_layout.fqn} from {p.dtype} on {p.device} "
                    f"to {out.dtype} on {out.device} after wrapping is not supported: the parameters are views "
                    "of the fp32 main shards. Set bf16/fp16 in smp.init for mixed precision (the main shards stay "
                    "fp32), and build or move the model before smp.DistributedModel for the device"
                )
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._post_partition_hooks:
            self._run_post_partition_hooks()
        return call_in_compute_dtype(self.module, self.policy.compute, args, kwargs)

    @property
    def nonfinite_losses(self) -> torch.Tensor:
        """How many losses passed to `backward` in the open window were not finite (a 0-d tensor)."""
        if self._nonfinite_losses is None:
            self._nonfinite_losses = torch.zeros((), dtype=torch.int64, device=self.device)
        return self._nonfinite_losses

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

        A non-finite loss is counted (`nonfinite_losses`, read only when a step is skipped) and
        multiplied by NaN, so every gradient it reaches is NaN and the optimizer skips the step on
        every rank ([Note: non-finite steps], optim/nonfinite.py); a finite one by 1.0, which is exact.
        """
        bad = torch.logical_not(torch.isfinite(loss.detach())).any()
        self.nonfinite_losses.add_(bad.to(self.device))
        scaled = loss * self.loss_scale if self.loss_scale != 1.0 else loss
        poison = torch.where(bad, float("nan"), 1.0).to(device=scaled.device, dtype=scaled.dtype)
        (scaled * poison).backward()

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

    def live_elements(self) -> int:
        """Unsharded elements alive right now."""
        return sum(u.num_live_elements for u in self.units)

    def all_sharded(self) -> bool:
        return all(u.state is UnitState.SHARDED for u in self.units)
