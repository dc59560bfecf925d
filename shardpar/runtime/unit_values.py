"""A unit's full values, for checkpoints and state dicts: gathered from its shards (fp32) and loaded
back into them. Split from unit.py, whose fields they read; only runtime/state.py calls them."""

from __future__ import annotations

import torch

from shardpar.runtime.holds import UnitState
from shardpar.runtime.unit import Unit


def gather_main(unit: Unit) -> torch.Tensor | None:
    """The unit's full flat fp32 main values, padded (one AllGather over the sharding group); a
    parameter is at [offset, offset + numel), a frozen one after the trainable layout's padded
    elements (its own AllGather, cast to fp32). None for a unit without elements."""
    if unit.gathered_numel == 0:
        return None
    full = torch.empty(unit.layout.padded_numel, dtype=torch.float32, device=unit.device)
    if unit.layout.numel:
        shard = unit.replicas.main_shard_values(unit)
        unit.comm.engine.all_gather(full, shard, unit.comm.sharding)
    if unit.frozen is None or unit.frozen.layout.numel == 0:
        return full
    return torch.cat([full, unit.frozen.gather_values().float()])


def full_params(unit: Unit) -> dict[str, torch.Tensor]:
    """Every parameter of the unit at full size (cloned, fp32), gathered from the main shards."""
    full = gather_main(unit)
    if full is None:
        return {}
    out = {s.fqn: full[s.offset : s.offset + s.numel].view(s.shape).clone() for s in unit.layout.specs}
    if unit.frozen is not None:
        base = unit.layout.padded_numel
        for s in unit.frozen.layout.specs:
            out[s.fqn] = full[base + s.offset : base + s.offset + s.numel].view(s.shape).clone()
    return out


def load_full_params(unit: Unit, values: dict[str, torch.Tensor]) -> None:
    """Set the main shard from full parameter values (every rank passes the same values)."""
    unit.drop_secondary()  # gathered from the old values
    if unit.frozen is not None:
        unit.frozen.load_full(values)
    with torch.no_grad():
        unit.replicas.load_full(unit, values)
        if unit.state is not UnitState.SHARDED and unit._full is not None:
            unit.wait_for_unshard()
            for p, spec in zip(unit.params, unit.layout.specs, strict=True):
                if spec.fqn in values:
                    p.data.copy_(values[spec.fqn].view(spec.shape))
