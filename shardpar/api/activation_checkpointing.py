"""`smp.set_activation_checkpointing` (SMP v1): a module's activations are recomputed in backward instead
of kept from forward.

A checkpointed module's class is swapped for a subclass whose `__call__` runs the original `__call__`
under a non-reentrant checkpoint (FSDP2's `fully_shard` swaps classes the same way). Parameter names,
state_dict keys and hooks stay as they were, and because `__call__` (not `forward`) is checkpointed the
module's hooks run again in the recomputation: a sharded unit's forward pre-hook sees it is inside a
backward and gathers the unit again with a BACKWARD hold (runtime/hooks.py).

On an `nn.ModuleList` / `nn.Sequential` the strategy says which children share a checkpoint:

    each         every child under its own torch.utils.checkpoint
    group_N      N consecutive children under one checkpoint (checkpoint_group.py); of a group only the
                 inputs of its first child are kept, the rest is recomputed from them
    contiguous   all children under one checkpoint

With `offload_activations` in the config, what each checkpoint keeps leaves the device after forward
(activation_offload.py); 'each' then runs through the group machinery with groups of one, since
torch.utils.checkpoint keeps its inputs where no one can move them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardpar.api.checkpoint_group import GroupCheckpoint, GroupFrame, without_kv_caches
from shardpar.api.context import activation_offloader
from shardpar.sharding.plan import CHECKPOINTED_BASE

_STRATEGIES = "'each', 'contiguous' or 'group_N' with an integer N >= 2 (e.g. 'group_2')"
_ATTR = "_shardpar_activation_checkpoint"  # the instance's _Installed (a plain attribute: no state_dict entry)


_Call = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any]  # (module, args, kwargs) -> output


@dataclass(frozen=True)
class _Setting:
    """What a module was checkpointed with; a second call with the same setting changes nothing."""

    owner: int  # id() of the module passed to set_activation_checkpointing
    strategy: str
    preserve_rng_state: bool


@dataclass(frozen=True)
class _Installed:
    setting: _Setting
    call: _Call


def base_call(module: nn.Module) -> Any:
    """The module's `__call__` as it was before checkpointing (hooks included), bound to it."""
    cls = type(module)
    return functools.partial(cls.__dict__[CHECKPOINTED_BASE].__call__, module)


def _each(preserve_rng_state: bool) -> _Call:
    def call(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        run = base_call(module)
        if not torch.is_grad_enabled():
            return run(*args, **kwargs)
        offloader = activation_offloader()
        if offloader is not None:
            frame = GroupFrame(preserve_rng_state=preserve_rng_state, offloader=offloader)
            return frame.run(0, module, run, args, kwargs)
        # Inside another checkpoint's recomputation this checkpoints again, as torch's nested checkpoints
        # do: the outer region saved none of this call's tensors in forward, so it must save none now.
        return checkpoint(
            _recompute_without_caches(run, kwargs), *args, use_reentrant=False, preserve_rng_state=preserve_rng_state
        )

    return call


def _recompute_without_caches(run: Callable[..., Any], kwargs: dict[str, Any]) -> Callable[..., Any]:
    """`run` with `kwargs`; from its second call on -- the recomputation in backward -- with every Hugging
    Face key/value cache among the arguments replaced by None.

    [Note: caches in a recomputation]
    A model called with use_cache=True (HF's default config) hands each layer a cache object that the
    layer's forward appends to. The recomputation would append to it a second time and read it back
    longer than in forward: T5's position bias and cross-attention then take another path, torch's
    checkpoint sees other tensors saved and raises CheckpointError, and a decoder-only model would
    attend over the forward's keys twice. The forward already wrote this layer's entry, and in training
    the cache it started from is empty, so the recomputation without a cache computes what the forward
    did. (transformers' own gradient checkpointing drops the cache for the same reason, forward included.)
    kwargs ride in the function, not through checkpoint(): names such as `debug` or `context_fn` would be
    taken as checkpoint's own options."""
    calls = 0

    def call(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return run(*args, **kwargs)
        bare_args, bare_kwargs = without_kv_caches(args, kwargs)
        return run(*bare_args, **bare_kwargs)

    return call


def _checkpointed_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    installed: _Installed = self.__dict__[_ATTR]
    return installed.call(self, args, kwargs)


def _swap_class(module: nn.Module, classes: dict[type, type]) -> None:
    cls = type(module)
    if cls not in classes:
        # Same name and qualname: the model prints as before, and code matching classes by name
        # (tensor_parallel/hf.py) still matches; sharding/plan.py sees the base through CHECKPOINTED_BASE.
        namespace = {
            "__call__": _checkpointed_call,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            CHECKPOINTED_BASE: cls,
        }
        classes[cls] = type(cls.__name__, (cls,), namespace)
    module.__class__ = classes[cls]


def _group_size(strategy: object) -> int | None:
    """1 for 'each', N for 'group_N', None for 'contiguous'."""
    if not isinstance(strategy, str):
        raise TypeError(f"strategy must be a string, {_STRATEGIES}; got {type(strategy).__name__} {strategy!r}")
    if strategy == "each":
        return 1
    if strategy == "contiguous":
        return None
    head, _, tail = strategy.partition("_")
    if head == "group" and tail.isdigit() and int(tail) >= 2:
        return int(tail)
    hint = " (a group of one is strategy='each')" if strategy == "group_1" else ""
    raise ValueError(f"strategy={strategy!r} is not a checkpointing strategy{hint}; use {_STRATEGIES}")


def _check_flags(preserve_rng_state: object, pack_args_as_tuple: object) -> None:
    for name, value in (("preserve_rng_state", preserve_rng_state), ("pack_args_as_tuple", pack_args_as_tuple)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def _check_not_set(modules: list[nn.Module], setting: _Setting, where: nn.Module) -> bool:
    """True when every module already has exactly `setting` (a repeated call: nothing to do); an error
    when any of them was checkpointed otherwise."""
    found = [m.__dict__.get(_ATTR) for m in modules]
    if all(f is not None and f.setting == setting for f in found):
        return True
    for m, f in zip(modules, found, strict=True):
        if f is not None:
            same_call = f.setting.owner == setting.owner
            how = f"strategy={f.setting.strategy!r}, preserve_rng_state={f.setting.preserve_rng_state}"
            inside = f" in the {type(where).__name__}" if m is not where else ""
            raise ValueError(
                f"{type(m).__name__}{inside} is already checkpointed "
                f"({how}{'' if same_call else ', through another call'}); "
                "set_activation_checkpointing cannot be undone or changed: call it once per module, "
                "with the strategy you want, on a model that was not checkpointed yet"
            )
    return False


def set_activation_checkpointing(
    module: nn.Module,
    preserve_rng_state: bool = True,
    pack_args_as_tuple: bool = False,
    strategy: str = "each",
) -> None:
    """Checkpoint `module` (SMP v1's signature): every call of it keeps only its inputs and recomputes the
    rest in backward. On an `nn.ModuleList` / `nn.Sequential`, `strategy` groups its children: 'each',
    'group_N' or 'contiguous' (module docstring). `preserve_rng_state` replays the forward's RNG state in
    the recomputation (dropout masks match). `pack_args_as_tuple` is accepted and changes nothing: v1's
    tracer needed it; here any arguments pass through. Call it before or after `smp.DistributedModel`."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"set_activation_checkpointing needs an nn.Module, got {type(module).__name__}")
    _check_flags(preserve_rng_state, pack_args_as_tuple)
    size = _group_size(strategy)
    setting = _Setting(owner=id(module), strategy=strategy, preserve_rng_state=preserve_rng_state)
    classes: dict[type, type] = {}
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        if strategy != "each":
            raise ValueError(
                f"strategy={strategy!r} groups the children of an nn.ModuleList or nn.Sequential; "
                f"{type(module).__name__} is neither: use strategy='each' (the default) to checkpoint it, "
                "or pass the list that holds it"
            )
        if not _check_not_set([module], setting, module):
            _install(module, _Installed(setting, _each(preserve_rng_state)), classes)
        return
    children = list(module.children())
    if not children:
        raise ValueError(
            f"set_activation_checkpointing: the {type(module).__name__} is empty; there is nothing to checkpoint"
        )
    if _check_not_set(children, setting, module):
        return
    size = len(children) if size is None else size
    for start in range(0, len(children), size):
        group = children[start : start + size]
        if len(group) == 1:
            _install(group[0], _Installed(setting, _each(preserve_rng_state)), classes)
            continue
        checkpointed = GroupCheckpoint(
            group, preserve_rng_state=preserve_rng_state, base_call=base_call, find_offloader=activation_offloader
        )
        for i, member in enumerate(group):
            _install(member, _Installed(setting, checkpointed.member_call(i)), classes)


def _install(module: nn.Module, installed: _Installed, classes: dict[type, type]) -> None:
    module.__dict__[_ATTR] = installed
    _swap_class(module, classes)


# ---- SMP v1's functional forms (smdistributed.modelparallel.torch.patches.checkpoint) ------------


def checkpoint_call(module: nn.Module, *args: Any, preserve_rng_state: bool = True) -> Any:
    """v1's `checkpoint(module, *args, preserve_rng_state=True)`: this one call of `module` under an
    activation checkpoint (offloaded with `offload_activations`). The module's hooks run again in the
    recomputation, so a sharded unit is gathered again. v1 took modules only, not functions."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint needs an nn.Module (SMP v1 checkpoints modules), got {type(module).__name__}")
    _check_flags(preserve_rng_state, False)
    if not torch.is_grad_enabled():
        return module(*args)
    offloader = activation_offloader()
    if offloader is not None:
        return GroupFrame(preserve_rng_state=preserve_rng_state, offloader=offloader).run(
            0, module, module.__call__, args, {}
        )
    return checkpoint(module, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)


def checkpoint_sequential(
    sequential_module: nn.Sequential,
    input: Any,
    strategy: str = "each",
    preserve_rng_state: bool = True,
    pack_args_as_tuple: bool = False,
) -> Any:
    """v1's `checkpoint_sequential`: run `sequential_module` on `input` with its children grouped by
    `strategy` ('each', 'group_N', 'contiguous'), each group under one checkpoint (checkpoint_group.py).
    `pack_args_as_tuple` is accepted and changes nothing: a tuple input reaches the first child whole."""
    if not isinstance(sequential_module, nn.Sequential):
        raise TypeError(f"checkpoint_sequential needs an nn.Sequential, got {type(sequential_module).__name__}")
    _check_flags(preserve_rng_state, pack_args_as_tuple)
    size = _group_size(strategy)
    children = list(sequential_module)
    size = len(children) if size is None else size
    out = input
    for start in range(0, len(children), size):
        frame = GroupFrame(preserve_rng_state=preserve_rng_state, offloader=activation_offloader())
        for i, child in enumerate(children[start : start + size]):
            out = frame.run(i, child, child.__call__, (out,), {}) if torch.is_grad_enabled() else child(out)
    return out
