"""Full-tensor state dicts of a DistributedModel: gathered unit by unit on save, checked and scattered
into the shards on load."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from shardpar.model import DistributedModel


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


def load_full_state_dict(model: DistributedModel, state_dict: Mapping[str, Any], strict: bool) -> None:
    """Load full tensors (as `full_state_dict` returns them) into the shards and persistent params.
    Every check runs before anything is written, and alike on every rank (each passes the same dict),
    so a bad checkpoint raises everywhere instead of leaving some ranks in the next collective."""
    names = {id(p): n for n, p in model.module.named_parameters(remove_duplicate=False)}
    missing = [n for n in names.values() if n not in state_dict]
    if strict and missing:
        raise ValueError(f"load_state_dict: missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}")
    _check_shapes(model, state_dict)
    for unit in model.units:
        unit.load_full_params({s.fqn: state_dict[s.fqn] for s in unit.layout.specs if s.fqn in state_dict})
    model.persistent.load(dict(state_dict))
    with torch.no_grad():
        for name, b in model.module.named_buffers():
            if name in state_dict:
                b.copy_(state_dict[name])


def _check_shapes(model: DistributedModel, state_dict: Mapping[str, Any]) -> None:
    """Like torch's "size mismatch for ...": the shards would take any tensor of enough elements."""
    expected = {s.fqn: s.shape for unit in model.units for s in unit.layout.specs}
    expected.update({name: p.shape for name, p in model.persistent.named})
    expected.update({name: b.shape for name, b in model.module.named_buffers()})
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
