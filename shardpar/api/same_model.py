"""Every rank must wrap the same model: same parameter and buffer names, shapes and dtypes, and the
same initial values.

Ranks that build different structures would issue different collectives and hang or abort inside the
transport (gloo's EnforceNotMet kills the process); ranks seeded differently would shard slices of
different initialisations into one model and start their replicas apart. DDP broadcasts rank 0's
values instead; a sharded model never holds the whole of it on one rank, so the ranks are checked: a
structure that differs is an error, values that differ a warning (a checkpoint loaded next makes
them equal) that says to seed alike.

One all_gather of two digests per rank. Only when they differ do the ranks exchange what they hold
(rank 0's description is broadcast, each rank names its first difference, those are gathered), so
every rank raises the same error before any unit is built.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import torch
from torch import nn

from shardpar.collectives import Group
from shardpar.collectives.native import all_gather_object, broadcast_object
from shardpar.runtime.state_dict import persistent_buffers
from shardpar.tensor_parallel.layers import tp_split_table

# Elements sampled per tensor for the value digest: a random initialisation differs everywhere, so a
# strided sample finds it without reading (or, on an accelerator, copying) every parameter.
_SAMPLE = 64

_Entry = tuple[str, tuple[int, ...], str]  # name, shape, dtype


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(remove_duplicate=False), *persistent_buffers(module).items()]


def _sample(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    step = max(1, flat.numel() // _SAMPLE)
    return flat[::step][:_SAMPLE].to(torch.float64)


def describe(module: nn.Module) -> tuple[list[_Entry], list[bytes | None]]:
    """(name, shape, dtype) of every parameter and persistent buffer, and a digest of a sample of each
    one's values (None where there are none yet, meta or deferred tensors, and for TP-split ones)."""
    tensors = _tensors(module)
    entries = [(name, tuple(t.shape), str(t.dtype)) for name, t in tensors]
    split = tp_split_table(module)  # converted by hand already: each TP rank holds its own slice
    real = [(i, t) for i, (name, t) in enumerate(tensors) if not t.is_meta and t.numel() and name not in split]
    digests: list[bytes | None] = [None] * len(tensors)
    if real:
        samples = [_sample(t) for _, t in real]
        values = torch.cat([s.to(samples[0].device) for s in samples]).cpu()  # one copy off the device
        offset = 0
        for (i, _), s in zip(real, samples, strict=True):
            digests[i] = hashlib.sha256(values[offset : offset + s.numel()].numpy().tobytes()).digest()
            offset += s.numel()
    return entries, digests


def _digest(items: list[Any]) -> str:
    return hashlib.sha256(repr(items).encode()).hexdigest()


def _show(entry: _Entry) -> str:
    return f"{list(entry[1])} {entry[2]}"


def _first_difference(mine: tuple[list[_Entry], list[bytes | None]], first: Any) -> str | None:
    entries, digests = mine
    ref_entries, ref_digests = first
    ref = {e[0]: (e, d) for e, d in zip(ref_entries, ref_digests, strict=True)}
    names = {e[0] for e in entries}
    for entry in entries:  # structure first: it decides the collectives
        name = entry[0]
        if name not in ref:
            return f"{name} ({_show(entry)}) is not in rank 0's model"
        if ref[name][0] != entry:
            return f"{name} is {_show(ref[name][0])} on rank 0 but {_show(entry)}"
    missing = [e[0] for e in ref_entries if e[0] not in names]
    if missing:
        return f"{missing[0]} of rank 0's model is missing"
    order = next((e[0] for e, r in zip(entries, ref_entries, strict=True) if e[0] != r[0]), None)
    if order is not None:  # units and their collectives follow registration order
        return f"the parameters are registered in another order than on rank 0 (from {order})"
    for entry, digest in zip(entries, digests, strict=True):
        ref_digest = ref[entry[0]][1]
        if (digest is None) != (ref_digest is None):
            state = ("not initialised yet (meta or deferred)", "initialised")
            here, there = (state[0], state[1]) if digest is None else (state[1], state[0])
            return f"{entry[0]} is {here} but {there} on rank 0"
        if digest != ref_digest:
            return f"{entry[0]} holds other initial values than on rank 0"
    return None


def check_same_model(module: nn.Module, world: Group) -> None:
    """Raise ValueError on every rank if any rank's model has another structure than rank 0's, warn on
    every rank if only the initial values differ (a collective)."""
    if world.size == 1:
        return
    mine = describe(module)
    digests = all_gather_object((_digest(mine[0]), _digest(mine[1])), world)
    if all(d == digests[0] for d in digests):
        return
    first = broadcast_object(mine, world.ranks[0], world)
    problems = all_gather_object(_first_difference(mine, first), world)
    reports = list(zip(world.ranks, digests, problems, strict=True))
    # A structure that differs anywhere is an error, even when a lower rank differs in values only.
    shaped = [(r, p) for r, d, p in reports if d[0] != digests[0][0]]
    if shaped:
        rank, problem = shaped[0]
        raise ValueError(
            f"smp.DistributedModel: the model differs between ranks: on rank {rank}, {problem}; build the same "
            "model on every rank"
        )
    rank, problem = next((r, p) for r, _, p in reports if p is not None)
    said = f"smp.DistributedModel: the model differs between ranks: on rank {rank}, {problem}"
    # Values only: harmless when a checkpoint or state dict is loaded next, so a warning, on every rank.
    warnings.warn(
        f"{said}. Unless a checkpoint or a state dict is loaded into it before training, the replicas start "
        "apart and the shards come from different initialisations: seed every rank alike "
        "(torch.manual_seed(seed)) before building the model",
        stacklevel=3,
    )
