"""Full-tensor state dicts of a sharded model (its ShardedState and the unchanged module): gathered
unit by unit on save, checked and scattered into the shards on load."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys  # what nn.Module.load_state_dict returns

from shardpar.collectives import Engine, Group
from shardpar.runtime.state import ShardedState
from shardpar.sharding.tp_split import TPSplit


def param_aliases(module: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name it has under `module` (a tied parameter has several), in order."""
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    return aliases


def local_param_shapes(state: ShardedState, module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every state-dict name of a parameter -> the module's (TP-local) shape of it."""
    out: dict[str, tuple[int, ...]] = {}
    for param_id, names in param_aliases(module).items():
        piece = state.piece_of_id(param_id)
        if piece is not None:
            out.update((n, piece.shape) for n in names)
    return out


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers that belong in a state dict, under every name (non-persistent ones are rebuilt by
    the model and left out, as torch leaves them out)."""
    keys = set(module.state_dict(keep_vars=True))
    return {n: b for n, b in module.named_buffers(remove_duplicate=False) if n in keys}


def full_state_dict(state: ShardedState, module: nn.Module, *, keep_vars: bool = False) -> dict[str, Any]:
    """Full tensors under `module`'s keys (parameters gathered unit by unit, fp32 main values). Buffers
    are cloned, or with `keep_vars` the module's own tensors, as torch gives them; a parameter is always
    a new tensor (a sharded one has no full tensor to hand out)."""
    values = state.full_values()
    out: dict[str, Any] = OrderedDict()
    for key, value in module.state_dict(keep_vars=True).items():
        piece = state.piece_of(value)  # the user parameter outside forward, the compute one inside
        if piece is not None:
            out[key] = values[piece.fqn]
        else:
            out[key] = value if keep_vars else value.detach().clone()
    return out


def load_full_state_dict(
    state: ShardedState, module: nn.Module, state_dict: Mapping[str, Any], strict: bool
) -> _IncompatibleKeys:
    """Load full tensors (as `full_state_dict` returns them) into the shards and persistent params.
    Every check runs before anything is written, and alike on every rank (each passes the same dict),
    so a bad checkpoint raises everywhere instead of leaving some ranks in the next collective.

    Like nn.Module.load_state_dict: keys that are neither a parameter nor a persistent buffer are
    unexpected, and strict raises on missing or unexpected ones; otherwise they are returned. A tied
    parameter is loaded from whichever of its names the dict holds, and is missing only when it
    holds none of them."""
    plan = _plan_load(state, module, state_dict)
    if strict and (plan.missing or plan.unexpected):
        raise ValueError(_strict_message(module, plan))
    state.load_full_values(plan.values)
    with torch.no_grad():
        for name, b in plan.buffers.items():
            if name in state_dict:
                b.copy_(state_dict[name])
    return _IncompatibleKeys(plan.missing, plan.unexpected)


@dataclass(frozen=True)
class _LoadPlan:
    values: dict[str, torch.Tensor]  # each parameter's value under its unit / persistent name
    buffers: dict[str, torch.Tensor]  # the persistent buffers (those a state dict holds), by every name
    missing: list[str]
    unexpected: list[str]


def _plan_load(state: ShardedState, module: nn.Module, state_dict: Mapping[str, Any]) -> _LoadPlan:
    """Resolve tied names and find missing and unexpected keys; raise on a size mismatch or on tied
    names holding different values. Reads the dict only, so it runs alike on every rank."""
    aliases = param_aliases(module)  # a tied parameter has several names; a dict may hold any of them
    known = list(module.state_dict(keep_vars=True))  # parameters, persistent buffers, extra state
    known_set = set(known)
    buffers = persistent_buffers(module)
    # the one name its unit or the persistent table uses, by the id of the object the module holds
    own = {pid: piece.fqn for pid in aliases if (piece := state.piece_of_id(pid)) is not None}
    _check_shapes(state, state_dict, aliases, own, buffers)
    values, absent = {}, set(buffers)
    for param_id, name in own.items():
        present = [a for a in aliases[param_id] if a in state_dict]
        if not present:
            absent.update(aliases[param_id])
            continue
        _check_tied_agree(state_dict, present)
        values[name] = state_dict[present[0]]
    missing = [k for k in known if k in absent and k not in state_dict]  # in the model's key order, as torch
    unexpected = [k for k in state_dict if k not in known_set]
    return _LoadPlan(values, buffers, missing, unexpected)


def _check_tied_agree(state_dict: Mapping[str, Any], present: list[str]) -> None:
    first = state_dict[present[0]]
    for other in present[1:]:
        if not torch.equal(state_dict[other], first):
            raise ValueError(
                f"load_state_dict: {present[0]!r} and {other!r} name one tied parameter but hold different "
                "values; keep one of the two keys (or give both the same tensor)"
            )


def _strict_message(module: nn.Module, plan: _LoadPlan) -> str:
    def some(keys: list[str]) -> str:
        return f"{keys[:5]}{f' (and {len(keys) - 5} more)' if len(keys) > 5 else ''}"

    parts = [f"missing keys {some(plan.missing)}"] if plan.missing else []
    parts += [f"unexpected keys {some(plan.unexpected)}"] if plan.unexpected else []
    return (
        f"load_state_dict(strict=True) into {type(module).__name__}: {'; '.join(parts)}. The state "
        "dict must hold every parameter (under any of its tied names) and persistent buffer, and nothing "
        "else; fix the keys, or pass strict=False to load what matches"
    )


def _check_shapes(
    state: ShardedState,
    state_dict: Mapping[str, Any],
    aliases: dict[int, list[str]],
    own: dict[int, str],
    buffers: dict[str, torch.Tensor],
) -> None:
    """Like torch's "size mismatch for ...": the shards would take any tensor of enough elements."""
    shape_of = {p.fqn: p.shape for p in state.pieces}
    expected = {alias: shape_of[name] for param_id, name in own.items() for alias in aliases[param_id]}
    # persistent buffers only: a non-persistent one in the dict is unexpected, whatever its shape (as torch)
    expected.update({n: b.shape for n, b in buffers.items()})
    bad = [
        f"{name}: the checkpoint has shape {tuple(value.shape)}, the model {tuple(expected[name])}"
        for name, value in state_dict.items()
        if name in expected and isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(expected[name])
    ]
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise ValueError(
            f"load_state_dict: size mismatch for {'; '.join(bad[:5])}{more}. Load a checkpoint saved from "
            "this model's architecture (same config, same tensor-parallel degree)"
        )


# ---- a DistributedModel nested in another module (nn.Module's recursion reaches it) ----------------


def nested_state_dict(
    state: ShardedState,
    module: nn.Module,
    destination: dict[str, Any] | None,
    prefix: str,
    *,
    keep_vars: bool,
    tp: TPLayout | None = None,
) -> dict[str, Any]:
    """`full_state_dict` under `prefix` (in the Hugging Face layout under tensor parallelism), written
    into `destination` when given (a parent's dict, whose `_metadata` gets the module versions its
    load_state_dict reads, as nn.Module writes them)."""
    full = full_state_dict(state, module, keep_vars=keep_vars)
    if tp is not None:
        full = tp.gather(full)
    if destination is None and not prefix:
        return full
    out: dict[str, Any] = OrderedDict() if destination is None else destination
    for key, value in full.items():
        out[prefix + key] = value
    metadata = getattr(out, "_metadata", None)
    if metadata is not None:
        for name, m in module.named_modules():
            metadata[(prefix + name).rstrip(".")] = {"version": m._version}
    return out


def load_nested(
    state: ShardedState,
    module: nn.Module,
    state_dict: Mapping[str, Any],
    prefix: str,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> bool:
    """A parent's load_state_dict reaching the wrapper at `prefix`: load the keys under it (the
    unwrapped model's keys, as `nested_state_dict` writes them) and report missing and unexpected ones
    and errors as nn.Module does (errors collected, not raised). True when it loaded: torch then
    recurses into the wrapped module, whose keys (`<prefix>module.*`) no dict holds, and
    `forget_inner_missing` takes those back out of the missing keys."""
    mine = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    try:
        result = load_full_state_dict(state, module, mine, strict=False)
    except ValueError as exc:  # a size mismatch or disagreeing tied names
        error_msgs.append(str(exc))
        return False
    missing_keys.extend(prefix + k for k in result.missing_keys)
    unexpected_keys.extend(prefix + k for k in result.unexpected_keys)
    return True


def forget_inner_missing(prefix: str, missing_keys: list[str]) -> None:
    inner = prefix + "module."
    missing_keys[:] = [k for k in missing_keys if not k.startswith(inner)]


# ---- tensor parallelism: the Hugging Face layout ---------------------------------------------------


@dataclass(frozen=True)
class TPLayout:
    """How the module's TP-split parameters relate to the full ones, and how to gather them."""

    splits: Mapping[str, TPSplit]  # by FQN, every name of a parameter (tp_split_table)
    engine: Engine
    group: Group  # this rank's TP group
    rank: int  # this rank's position in it

    def gather(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """TP-local tensors -> the full Hugging Face layout (a collective over the TP group: every TP
        rank calls it with the same keys, in the same order)."""
        for key, value in state_dict.items():
            split = self.splits.get(key)
            if split is None or not isinstance(value, torch.Tensor):
                continue
            local = value.detach().contiguous()
            out = torch.empty(self.group.size * local.numel(), dtype=local.dtype, device=local.device)
            self.engine.all_gather(out, local.view(-1), self.group)
            state_dict[key] = split.full_of(list(out.view(self.group.size, *local.shape).unbind(0)))
        return state_dict

    def local(self, state_dict: Mapping[str, Any], local_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
        """This TP rank's piece of each full-layout tensor of `state_dict`; a tensor already of the
        TP-local shape is taken as it is (what `local_state_dict`-era code saved)."""
        out = dict(state_dict)
        for key, value in state_dict.items():
            split, shape = self.splits.get(key), local_shapes.get(key)
            if split is None or shape is None or not isinstance(value, torch.Tensor):
                continue
            if tuple(value.shape) == split.full_shape(shape):
                out[key] = split.local_of(value, self.rank)
        return out
