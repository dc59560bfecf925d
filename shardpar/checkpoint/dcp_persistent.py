"""After `dcp.load`: the rows of persistent tensors that other ranks read.

A persistent parameter (and its optimizer state) is whole on every rank, but each rank of its sharding
group describes only its own row block to torch.distributed.checkpoint (runtime/dcp_chunks.py,
`persistent_rows`), so that a rank reads one saved block of each instead of all of them. `dcp.load`
therefore leaves a rank with its own rows of such a tensor and stale values in the rest. `complete`
puts the rest in from the other ranks of the group: one all_gather per group and dtype for all the
tensors of a state dict, packed end to end. It copies bits, so the values are exactly the saved ones.

It runs at the start of `set_model_state_dict` / `set_optimizer_state_dict` on every ShardedTensor value
of a persistent layout, whatever produced it: a value that was whole already (a state dict not loaded
through DCP) is gathered into itself, since every rank of the group holds the same persistent values.
A collective: every rank of the group calls it with the same keys in the same order, as those calls
are made (each rank passes a state dict of the same model)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from shardpar.runtime import dcp_chunks
from shardpar.runtime.sharded_tensor import ShardedTensor


def persistent_values(values: Iterable[Any]) -> list[ShardedTensor]:
    """The ShardedTensors among `values` (nested dicts and lists searched, each object once, in order)
    that DCP saw as row blocks of a whole tensor."""
    found: dict[int, ShardedTensor] = {}

    def visit(value: Any) -> None:
        if isinstance(value, ShardedTensor):
            if dcp_chunks.split_whole(value.shard_layout) and value.numel() > 0:
                found.setdefault(id(value), value)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    for v in values:
        visit(v)
    return list(found.values())


def complete(values: Iterable[Any], device: torch.device) -> None:
    """Fill in place every persistent ShardedTensor among `values` with the rows the other ranks of its
    group read (module docstring). `device`: where the engine communicates (the model's)."""
    batches: dict[tuple[tuple[int, ...], torch.dtype], list[ShardedTensor]] = {}
    for t in persistent_values(values):
        batches.setdefault((t.shard_layout.comm.sharding.ranks, t.dtype), []).append(t)
    for (_, dtype), tensors in batches.items():
        _gather(tensors, dtype, device)


def _gather(tensors: list[ShardedTensor], dtype: torch.dtype, device: torch.device) -> None:
    comm = tensors[0].shard_layout.comm
    parts = comm.sharding.size
    # Each tensor takes a slot of one block (ceil(rows / parts) rows) per rank; shorter blocks are padded.
    shapes = [tuple(t.shape) for t in tensors]
    rows = [s[0] if s else 1 for s in shapes]
    inner = [math.prod(s[1:]) for s in shapes]
    slots = [-(-r // parts) * i for r, i in zip(rows, inner, strict=True)]
    total = sum(slots)
    mine = torch.zeros(total, dtype=dtype, device=device)
    offset = 0
    for t, i, slot in zip(tensors, inner, slots, strict=True):
        first, end = dcp_chunks.persistent_rows(t.shard_layout)
        mine[offset : offset + (end - first) * i] = t.local_piece.reshape(-1)[first * i : end * i]
        offset += slot
    out = torch.empty(parts * total, dtype=dtype, device=device)
    comm.engine.all_gather(out, mine, comm.sharding)
    blocks = out.view(parts, total)
    offset = 0
    for t, r, i, slot in zip(tensors, rows, inner, slots, strict=True):
        flat = t.local_piece.view(-1)  # whole and contiguous: a view, so the writes land in the tensor
        for index in range(parts):
            first, end = dcp_chunks.row_block(r, parts, index)
            if end > first:
                flat[first * i : end * i] = blocks[index, offset : offset + (end - first) * i]
        offset += slot
