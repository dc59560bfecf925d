"""Full-tensor state dicts of a DistributedModel: gathered unit by unit on save, checked and scattered
into the shards on load."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys  # what nn.Module.load_state_dict returns

if TYPE_CHECKING:
    from shardpar.runtime.model import DistributedModel


def param_aliases(module: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name it has under `module` (a tied parameter has several), in order."""
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    return aliases


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers that belong in a state dict, under every name (non-persistent ones are rebuilt by
    the model and left out, as torch leaves them out)."""
    keys = set(module.state_dict(keep_vars=True))
    return {n: b for n, b in module.named_buffers(remove_duplicate=False) if n in keys}


def full_state_dict(model: DistributedModel) -> dict[str, Any]:
    """Full tensors under the unwrapped model's keys (gathered unit by unit)."""
    full: dict[int, torch.Tensor] = {}
    for unit in model.units:
        values = unit.full_params()
        for p, spec in zip(unit.params, unit.layout.specs, strict=True):
            full[id(p)] = values[spec.fqn]
    for i, p in enumerate(model.persistent.params):
        full[id(p)] = model.persistent.main_view(i).detach().clone()  # fp32 main, not the compute copy
    out: dict[str, Any] = OrderedDict()
    for key, value in model.module.state_dict(keep_vars=True).items():
        out[key] = full[id(value)] if id(value) in full else value.detach().clone()
    return out


def load_full_state_dict(model: DistributedModel, state_dict: Mapping[str, Any], strict: bool) -> _IncompatibleKeys:
    """Load full tensors (as `full_state_dict` returns them) into the shards and persistent params.
    Every check runs before anything is written, and alike on every rank (each passes the same dict),
    so a bad checkpoint raises everywhere instead of leaving some ranks in the next collective.

    Like nn.Module.load_state_dict: keys that are neither a parameter nor a persistent buffer are
    unexpected, and strict raises on missing or unexpected ones; otherwise they are returned. A tied
    parameter is loaded from whichever of its names the dict holds, and is missing only when it
    holds none of them."""
    plan = _plan_load(model, state_dict)
    if strict and (plan.missing or plan.unexpected):
        raise ValueError(_strict_message(model, plan))
    for unit in model.units:
        unit.load_full_params({s.fqn: plan.values[s.fqn] for s in unit.layout.specs if s.fqn in plan.values})
    model.persistent.load({name: plan.values[name] for name, _ in model.persistent.named if name in plan.values})
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


def _plan_load(model: DistributedModel, state_dict: Mapping[str, Any]) -> _LoadPlan:
    """Resolve tied names and find missing and unexpected keys; raise on a size mismatch or on tied
    names holding different values. Reads the dict only, so it runs alike on every rank."""
    module = model.module
    aliases = param_aliases(module)  # a tied parameter has several names; a dict may hold any of them
    known = list(module.state_dict(keep_vars=True))  # parameters, persistent buffers, extra state
    known_set = set(known)
    buffers = persistent_buffers(module)
    own = _own_names(model)
    _check_shapes(model, state_dict, aliases, own, buffers)
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


def _own_names(model: DistributedModel) -> dict[int, str]:
    """id(parameter) -> the one name its unit or the persistent table keys it under."""
    names = {id(p): s.fqn for unit in model.units for p, s in zip(unit.params, unit.layout.specs, strict=True)}
    names.update({id(p): name for name, p in model.persistent.named})
    return names


def _check_tied_agree(state_dict: Mapping[str, Any], present: list[str]) -> None:
    first = state_dict[present[0]]
    for other in present[1:]:
        if not torch.equal(state_dict[other], first):
            raise ValueError(
                f"load_state_dict: {present[0]!r} and {other!r} name one tied parameter but hold different "
                "values; keep one of the two keys (or give both the same tensor)"
            )


def _strict_message(model: DistributedModel, plan: _LoadPlan) -> str:
    def some(keys: list[str]) -> str:
        return f"{keys[:5]}{f' (and {len(keys) - 5} more)' if len(keys) > 5 else ''}"

    parts = [f"missing keys {some(plan.missing)}"] if plan.missing else []
    parts += [f"unexpected keys {some(plan.unexpected)}"] if plan.unexpected else []
    return (
        f"load_state_dict(strict=True) into {type(model.module).__name__}: {'; '.join(parts)}. The state "
        "dict must hold every parameter (under any of its tied names) and persistent buffer, and nothing "
        "else; fix the keys, or pass strict=False to load what matches"
    )


def _check_shapes(
    model: DistributedModel,
    state_dict: Mapping[str, Any],
    aliases: dict[int, list[str]],
    own: dict[int, str],
    buffers: dict[str, torch.Tensor],
) -> None:
    """Like torch's "size mismatch for ...": the shards would take any tensor of enough elements."""
    shape_of = {s.fqn: s.shape for unit in model.units for s in unit.layout.specs}
    shape_of.update({name: p.shape for name, p in model.persistent.named})
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
