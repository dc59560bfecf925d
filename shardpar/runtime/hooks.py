"""The hooks that drive a DistributedModel: they tell the Scheduler and the reducer what happened, and
free nothing themselves.

    forward:   pre-forward(unit)  -> scheduler.require(FORWARD)      post-forward(unit) -> scheduler.forward_done
    backward:  grad of unit output -> scheduler.require(BACKWARD)     all unit grads in  -> ReduceScatter,
                                                                                           scheduler.backward_done
               (a unit with frozen parameters: scheduler.backward_done once its whole backward ran,
               [Note: frozen units' backward])
    end of backward (autograd callback): units not reduced yet -> ReduceScatter (zeros where no grad);
               at the accumulation boundary -> AllReduce main grads over the replication group and
               persistent grads over the rdp group; scheduler.end_backward frees every unit.

The root unit keeps its parameters after a forward that records a graph (its lm_head is the first
thing backward needs; FSDP2 does the same) and frees them when backward ends. See [Note: holders]
in unit.py for how shared parameters stay alive.

[Note: frozen units' backward]
A unit's gathered parameters may be freed once no backward node that saved them is left to run. For a
trainable unit that is when its last gradient arrives: every op that used a trainable weight has that
weight as a differentiable input, so its node runs before the weight's grad is accumulated. A frozen
weight gives no such signal (LoRA: every block's base weights are frozen, and the adapters' grads may
arrive before the frozen matmul that computes the block's input gradient), so until issue 33 such units
stayed gathered to the end of backward -- the whole model beside the activations.

A node of a unit's backward leads, through other nodes of the unit, to where its gradients go: the
tensor inputs of the unit's call, or leaves -- the parameters the unit uses. So a unit with frozen
parameters is done once
  * every graph-recording call of it has seen the gradients of its tensor inputs (args and kwargs)
    that require grad: they pass through `_CallBackwardDone`, whose backward runs after every node
    that leads to them (FSDP2's post-backward sits in the same place); a call whose graph is freed
    without running backward (a non-reentrant checkpoint's recomputation, a forward never backwarded)
    closes when its node goes (`weakref.finalize` on a token the node holds); and
  * every trainable parameter of its own -- sharded, or persistent and held by its modules -- got its
    gradient accumulated in this backward (a set, not a count: a reentrant checkpoint run twice
    delivers a grad twice).
Under reentrant activation checkpointing the forward runs without a graph and the recomputation, inside
backward, records the real one, so its call goes through `_CallBackwardDone` too; the non-reentrant
recomputation's graph is dropped, which closes its call, and the forward's call closes in the real graph.
A unit with no such input and no trainable parameter of its own gets neither signal and stays until
the end of backward, as do the root and any unit whose forward runs other units (their nodes lead to
other units' inputs and leaves), and a unit that borrows parameters (its nodes may lead only to the
lender's). Freeing too early would not be silent: a saved view of resized storage crashes the rank
([Note: gathered storage] in unit.py).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from shardpar.runtime.holds import BACKWARD, HoldKind
from shardpar.runtime.persistent import PersistentParams
from shardpar.runtime.reducer import GradReducer
from shardpar.runtime.schedule import Scheduler
from shardpar.runtime.unit import Unit
from shardpar.runtime.user_params import UserParams
from shardpar.runtime.window import AccumulationWindow


def _eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A hook that torch.compile runs as it is, between compiled graphs: it gathers, frees, swaps the
    modules' parameters and issues collectives -- host-side bookkeeping a graph must not bake in.
    [Note: torch.compile] in docs/design.md: the graph breaks fall at the unit boundaries."""
    return torch.compiler.disable(fn, recursive=True)


def _weakly(method: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """`method` (a ModelHooks method) through a weak reference, for hooks that C++ holds.

    [Note: hook cycles] A post-accumulate-grad hook is kept by the parameter's autograd metadata, a C++
    reference the garbage collector cannot see. A hook holding the ModelHooks strongly makes the cycle
    parameter -> hook -> ModelHooks -> units -> parameter uncollectable: every model ever wrapped, its
    shards and the process groups its topology holds (3 gloo threads and a socket per peer each) stay
    alive after smp.shutdown(), for the life of the process. The model keeps its ModelHooks alive;
    once the model is gone the hook finds nothing and does nothing."""
    ref = weakref.WeakMethod(method)

    def call(p: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(p)

    return call


def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, Mapping):  # HF ModelOutput is an OrderedDict
        return [t for v in obj.values() for t in _tensors(v)]
    return [t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


class ModelHooks:
    """Installs and runs the forward/backward hooks of `root`'s units."""

    def __init__(
        self,
        root: nn.Module,
        units: list[Unit],
        persistent: PersistentParams,
        *,
        scheduler: Scheduler,
        reducer: GradReducer,
        window: AccumulationWindow,
        unit_of_param: dict[int, Unit],
        unit_of_persistent: Mapping[int, int],
        user_params: UserParams,
        on_window_end: Callable[[], None],
        on_backward_end: Callable[[bool], None],
        on_forward_start: Callable[[], None],
    ) -> None:
        self.root = root
        self.units = units
        self.persistent = persistent
        self.scheduler = scheduler
        self.reducer = reducer
        self.window = window
        self._unit_of_param = unit_of_param
        self._on_window_end = on_window_end  # after the boundary's collectives ([Note: unused params] in model.py)
        self._on_backward_end = on_backward_end  # (whether it ended the window): publish the user grads
        self._on_forward_start = on_forward_start  # refresh compute copies a plain optimizer left stale
        self.user_params = user_params
        self._finalize_queued_for: int | None = None
        self.handles: list[Any] = []
        # [Note: frozen units' backward]: the units freed once their whole backward ran, and for each
        # trainable parameter the units whose backward it is part of.
        self._frozen_release = _frozen_release_units(root, units)
        self._frozen_sinks: dict[int, list[Unit]] = {}
        self._sinks: dict[int, frozenset[int]] = {}  # unit index -> its parameters' ids
        self._sinks_seen: dict[int, set[int]] = {}
        persistent_by_unit: dict[int, list[nn.Parameter]] = {}
        for p in persistent.params:
            if p.requires_grad and id(p) in unit_of_persistent:
                persistent_by_unit.setdefault(unit_of_persistent[id(p)], []).append(p)
        for unit in units:
            if unit.index in self._frozen_release:
                own = [p for p in unit.params if p.requires_grad] + persistent_by_unit.get(unit.index, [])
                self._sinks[unit.index] = frozenset(id(p) for p in own)
                self._sinks_seen[unit.index] = set()
                for p in own:
                    self._frozen_sinks.setdefault(id(p), []).append(unit)

    def install(self) -> None:
        for unit in self.units:
            pre = _eager(self._make_pre_forward(unit))
            self.handles.append(unit.module.register_forward_pre_hook(pre, with_kwargs=True))
            self.handles.append(unit.module.register_forward_hook(_eager(self._make_post_forward(unit))))
            for p in unit.params:
                if p.requires_grad:
                    self.handles.append(
                        p.register_post_accumulate_grad_hook(_eager(_weakly(self._on_grad_accumulated)))
                    )
        for p in self.persistent.params:
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(_eager(_weakly(self._on_grad_accumulated))))
        self.handles.append(self.root.register_forward_pre_hook(_eager(self._root_pre_forward)))

    # ---- forward ------------------------------------------------------------------------------

    def _make_pre_forward(self, unit: Unit) -> Any:
        is_root = unit.module is self.root

        tracks_calls = bool(unit.deps) or unit.index in self._frozen_release

        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            # During backward this is an activation-checkpoint recomputation: the unit belongs to
            # its backward until its grads are reduced.
            backward = _in_backward()
            if is_root and not backward:
                # A new forward: modules hold the user parameters whatever a forward that raised left
                # ([Note: two parameters per original] in user_params.py).
                self.user_params.reset()
                self._on_forward_start()
            self.scheduler.require(unit, HoldKind.BACKWARD if backward else HoldKind.FORWARD)
            self.user_params.enter(unit)
            # Also in a recomputation: a reentrant checkpoint's is the graph backward runs.
            if tracks_calls and torch.is_grad_enabled():
                return self._after_backward_of_call(unit, args, kwargs)
            return None

        return hook

    def _make_post_forward(self, unit: Unit) -> Any:
        is_root = unit.module is self.root

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            self.user_params.exit(unit)
            records_graph = torch.is_grad_enabled()
            if records_graph:
                self._register_pre_backward(unit, output)
            if not (is_root and records_graph):
                self.scheduler.forward_done(unit)
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

    def _after_backward_of_call(
        self, unit: Unit, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """A graph-recording call of a unit that borrows parameters or has frozen ones: route its tensor
        inputs that require grad (args and kwargs) through _CallBackwardDone, so that what waits for its
        backward ends with it ([Note: holders] in unit.py, [Note: frozen units' backward]). Without such
        inputs nothing waits for the call."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        positions = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not positions:
            return None
        token = self.scheduler.open_call(unit)
        passed = _CallBackwardDone.apply(self, unit, token, *(leaves[i] for i in positions))
        for i, t in zip(positions, passed, strict=True):
            leaves[i] = t
        new_args, new_kwargs = pytree.tree_unflatten(leaves, spec)
        return tuple(new_args), dict(new_kwargs)

    def _call_closed(self, unit: Unit, token: int) -> None:
        """_CallBackwardDone's backward ran, or its node was freed without running."""
        if self.scheduler.close_call(unit, token):
            self._release_if_backward_ran(unit)

    def _release_if_backward_ran(self, unit: Unit) -> None:
        """Free a unit with frozen parameters once its whole backward ran ([Note: frozen units' backward])."""
        sinks = self._sinks.get(unit.index)
        if sinks is None or unit.open_calls or self._sinks_seen[unit.index] != sinks:
            return
        if unit.num_trainable and not unit.reduced:
            return  # (its grads are handed to the reducer first, in _on_grad_accumulated)
        if not _in_backward() or BACKWARD not in unit.holds:
            return  # a graph freed outside backward closed the call; the unit is not in its backward
        self.scheduler.backward_done(unit)
        self.user_params.exit_backward(unit)

    # ---- backward -----------------------------------------------------------------------------

    def _register_pre_backward(self, unit: Unit, output: Any) -> None:
        # Weakly, as the post-accumulate-grad hooks ([Note: hook cycles]): the hook lives on the output's
        # autograd node (C++), and a graph tensor kept anywhere in the model would close an uncollectable
        # cycle through it.
        hooks_ref, unit_ref = weakref.ref(self), weakref.ref(unit)

        def on_grad(grad: torch.Tensor) -> None:
            hooks, unit = hooks_ref(), unit_ref()
            if hooks is None or unit is None:
                return
            hooks._queue_finalize()
            if not unit.reduced:
                hooks.scheduler.require(unit, HoldKind.BACKWARD)
                hooks.user_params.enter_backward(unit)

        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(_eager(on_grad))

    def _on_grad_accumulated(self, p: torch.Tensor) -> None:
        self._queue_finalize()
        unit = self._unit_of_param.get(id(p))
        if unit is None:
            self._sink_arrived(p)
            return  # persistent: reduced at the boundary
        if unit.reduced:
            raise late_gradient(unit, p)
        unit.grads_arrived += 1
        if unit.grads_arrived == unit.num_trainable:
            self.reducer.add(unit)
            if not unit.has_frozen:
                self.scheduler.backward_done(unit)
                self.user_params.exit_backward(unit)
        self._sink_arrived(p)

    def _sink_arrived(self, p: torch.Tensor) -> None:
        for unit in self._frozen_sinks.get(id(p), ()):
            self._sinks_seen[unit.index].add(id(p))
            self._release_if_backward_ran(unit)

    def _queue_finalize(self) -> None:
        # Queue once per outermost backward: a reentrant activation checkpoint runs nested backward
        # graph tasks whose end is not the end of the step's backward.
        if self._finalize_queued_for is not None:
            return
        self._finalize_queued_for = torch._C._current_graph_task_id()
        # What the user did to the .grads since the last backward ([Note: user gradients] in user_params.py).
        self.user_params.sync()
        for unit in self.units:
            unit.begin_backward()
        for seen in self._sinks_seen.values():
            seen.clear()
        boundary = self.window.begin_backward()
        self.reducer.begin_backward(boundary=boundary, scale=self.window.grad_scale)
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        self._finalize_queued_for = None
        for unit in self.units:
            if unit.num_trainable and not unit.reduced:
                self.reducer.add(unit)
        # See [Note: micro-batch averaging] in model.py.
        scale = self.window.grad_scale
        self.reducer.drain(scale=scale)
        self.persistent.collect_grads(scale=scale)
        boundary = self.window.ends_window
        self.window.end_backward()
        if boundary:
            if not self.reducer.replicates:  # else the buckets carried it ([Note: replication in the bucket])
                for unit in self.units:
                    unit.finish_accumulation()
            self._on_window_end()
        self.scheduler.end_backward()
        self.user_params.reset()
        self._on_backward_end(boundary)


def _close_weakly(hooks: weakref.ref[ModelHooks], unit: weakref.ref[Unit], token: int) -> None:
    h, u = hooks(), unit()
    if h is not None and u is not None:
        h._call_closed(u, token)


class _CallBackwardDone(torch.autograd.Function):
    """Identity on a forward call's tensor inputs; its backward runs once the gradients of all of them
    are computed -- the call's whole backward has run -- and before they flow on to whoever produced
    the inputs (FSDP2 puts its post-backward in the same place). If its node is freed without running
    (the graph was dropped), the call closes then ([Note: frozen units' backward])."""

    @staticmethod
    def forward(ctx: Any, hooks: ModelHooks, unit: Unit, token: int, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Weakly: the node is a C++ object, invisible to gc; a strong reference from it to the hooks (and
        # through them the model, its units and their process groups) would keep the model alive for as
        # long as any tensor of its graph is ([Note: hook cycles]).
        ctx.close = functools.partial(_close_weakly, weakref.ref(hooks), weakref.ref(unit), token)
        ctx.node_alive = _NodeAlive()  # owned by the node alone: finalized when the node goes
        weakref.finalize(ctx.node_alive, ctx.close)
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.close()
        return (None, None, None, *grads)


class _NodeAlive:
    __slots__ = ("__weakref__",)


def _frozen_release_units(root: nn.Module, units: list[Unit]) -> set[int]:
    """Indices of the units freed once their whole backward ran ([Note: frozen units' backward]):
    those with frozen parameters, except the root, a unit whose module holds another unit's, and a unit
    that borrows parameters."""
    modules = {id(u.module) for u in units}
    out = set()
    for unit in units:
        if not unit.has_frozen or unit.module is root or unit.deps:
            continue
        if any(id(m) in modules for m in unit.module.modules() if m is not unit.module):
            continue
        out.add(unit.index)
    return out


def late_gradient(unit: Unit, p: torch.Tensor) -> RuntimeError:
    """A gradient for a unit whose gradients this backward already reduced: it would be left on .grad,
    never reduced, and added into the next step's gradient."""
    name = next((s.fqn for q, s in zip(unit.params, unit.layout.specs, strict=True) if q is p), "?")
    return RuntimeError(
        f"{name} (unit {unit.name}) got a gradient after the unit's gradients were reduced in this backward. "
        "The unit ran more than once inside reentrant activation checkpointing "
        "(torch.utils.checkpoint(..., use_reentrant=True)), whose nested backwards deliver each use's "
        "gradient apart; checkpoint it with use_reentrant=False, as PyTorch recommends"
    )
