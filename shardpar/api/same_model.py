"""Every rank must wrap the same model: same parameter and buffer names, shapes and dtypes, each built
the same way (initialised, or still on meta under delayed initialization).

Ranks that build different structures would issue different collectives and hang or abort inside the
transport (gloo's EnforceNotMet kills the process). Values may differ: wrapping takes every rank's
initial values from rank 0, as DDP does ([Note: rank 0's initial values], runtime/initial_values.py),
which needs each parameter to be real on every rank or meta on every rank.

One all_gather of a digest per rank. Only when they differ do the ranks exchange what they hold
(rank 0's description is broadcast, each rank names its first difference, those are gathered), so
every rank raises the same error before any unit is built.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from shardpar.collectives import Group
from shardpar.collectives.native import all_gather_object, broadcast_object
from shardpar.runtime.state_dict import persistent_buffers

_Entry = tuple[str, tuple[int, ...], str, bool]  # name, shape, dtype, on meta


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(remove_duplicate=False), *persistent_buffers(module).items()]


def describe(module: nn.Module) -> list[_Entry]:
    """(name, shape, dtype, on meta) of every parameter and persistent buffer, in registration order."""
    return [(name, tuple(t.shape), str(t.dtype), t.is_meta) for name, t in _tensors(module)]


def _digest(items: list[Any]) -> str:
    return hashlib.sha256(repr(items).encode()).hexdigest()


def _show(entry: _Entry) -> str:
    return f"{list(entry[1])} {entry[2]}"


def _state(entry: _Entry) -> str:
    return "on meta (not initialised yet)" if entry[3] else "initialised"


def _first_difference(entries: list[_Entry], ref_entries: list[_Entry]) -> str | None:
    ref = {e[0]: e for e in ref_entries}
    names = {e[0] for e in entries}
    for entry in entries:  # structure first: it decides the collectives
        name = entry[0]
        if name not in ref:
            return f"{name} ({_show(entry)}) is not in rank 0's model"
        if ref[name][1:3] != entry[1:3]:
            return f"{name} is {_show(ref[name])} on rank 0 but {_show(entry)}"
    missing = [e[0] for e in ref_entries if e[0] not in names]
    if missing:
        return f"{missing[0]} of rank 0's model is missing"
    order = next((e[0] for e, r in zip(entries, ref_entries, strict=True) if e[0] != r[0]), None)
    if order is not None:  # units and their collectives follow registration order
        return f"the parameters are registered in another order than on rank 0 (from {order})"
    for entry in entries:
        if entry[3] != ref[entry[0]][3]:
            return f"{entry[0]} is {_state(entry)} but {_state(ref[entry[0]])} on rank 0"
    return None


def check_same_model(module: nn.Module, world: Group) -> None:
    """Raise ValueError on every rank if any rank's model has another structure than rank 0's (a
    collective). Initial values are not compared: wrapping takes rank 0's."""
    if world.size == 1:
        return
    mine = describe(module)
    digests = all_gather_object(_digest(mine), world)
    if all(d == digests[0] for d in digests):
        return
    first = broadcast_object(mine, world.ranks[0], world)
    problems = all_gather_object(_first_difference(mine, first), world)
    rank, problem = next((r, p) for r, p in zip(world.ranks, problems, strict=True) if p is not None)
    raise ValueError(
        f"smp.DistributedModel: the model differs between ranks: on rank {rank}, {problem}; build the same "
        "model on every rank"
    )
