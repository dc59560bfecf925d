"""Full checkpoints: the consolidated model as a Hugging Face directory, streamed unit by unit.

    <tag>/
        config.json, generation_config.json     (a PreTrainedModel with translate_if_full=True)
        model.safetensors                       one file, or with max_shard_size:
        model-00001-of-0000N.safetensors ...    + model.safetensors.index.json (HF's sharded layout)
        shardpar_full.json                      manifest: file sizes, tensor checksums, checkpoint id,
                                                user_content

Only replica 0's sharding groups work: each AllGathers one unit at a time (fp32 main shards); with
tensor parallelism the TP group of rank 0 then AllGathers that unit over TP and rebuilds every
TP-split parameter in the original layout (TPSplit.full_of). Rank 0 writes the unit's tensors
straight into the pre-computed safetensors layout, so no rank ever holds more than one unit's full
parameters (times tp). Keys are the unwrapped model's state_dict keys, with tied aliases dropped the
way `save_pretrained` drops them, so `from_pretrained(dir)` reports no missing keys and builds the
unconverted model. Optimizer state is not part of a full checkpoint (use partial=True to resume
training). Loading is full_load.py.
"""

from __future__ import annotations

import copy
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardpar.checkpoint import index as ix
from shardpar.checkpoint.pieces import persistent_buffers
from shardpar.checkpoint.placement import Cut
from shardpar.checkpoint.safetensors_io import (
    SafetensorsWriter,
    TensorEntry,
)
from shardpar.runtime.model import DistributedModel
from shardpar.sharding.tp_split import TPSplit
from shardpar.tensor_parallel.comm import TPComm
from shardpar.tensor_parallel.layers import tp_split_table

MANIFEST = "shardpar_full.json"
FULL_FORMAT = "shardpar.full"
SINGLE_FILE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Item:
    """One tensor of the export: its HF key and where its values come from."""

    key: str
    source: str  # "unit" | "persistent" | "buffer"
    unit: int  # unit index ("unit"), else -1
    pos: int  # spec index in the unit / index in the persistent set / -1
    name: str  # FQN or buffer name
    entry: TensorEntry  # the full (Hugging Face) shape
    split: TPSplit | None = None  # how TP ranks' local parameters make up this one; None: replicated


def _tied_patterns(module: nn.Module) -> list[str]:
    """HF's tied-weight key patterns (`_tied_weights_keys`: a dict in transformers 5, a list before)."""
    out = []
    for name, sub in module.named_modules():
        for k in getattr(sub, "_tied_weights_keys", None) or []:
            out.append(f"{name}.{k}" if name else k)
    return out


def export_keys(module: nn.Module) -> dict[str, Any]:
    """state_dict key -> parameter/buffer object, minus tied aliases and `_keys_to_ignore_on_save`.

    Mirrors transformers' remove_tied_weights_from_state_dict: among keys naming one tensor, those
    matching a tied pattern are dropped (sorted order) until one is left; with no pattern the first
    key in state_dict order is kept.
    """
    sd = module.state_dict(keep_vars=True)
    for pattern in getattr(module, "_keys_to_ignore_on_save", None) or []:
        sd.pop(pattern, None)
    groups: dict[int, list[str]] = {}
    for key, value in sd.items():
        groups.setdefault(id(value), []).append(key)
    patterns = _tied_patterns(module)
    drop: set[str] = set()
    for names in groups.values():
        if len(names) < 2:
            continue
        tied = [n for n in sorted(names) if any(re.search(p, n) for p in patterns)]
        drop.update(tied[: len(names) - 1] if tied else [])
        left = [n for n in names if n not in drop]
        drop.update(left[1:])
    return {k: v for k, v in sd.items() if k not in drop}


def plan_items(model: DistributedModel, dtype: torch.dtype | None) -> list[Item]:
    """Every exported tensor, in streaming order: unit by unit, then persistent params and buffers."""
    state = model.sharded_state
    buffers, splits = persistent_buffers(model), tp_split_table(model.module)
    items = []
    for key, value in export_keys(model.module).items():
        if (p := state.piece_of(value)) is not None:
            source, unit, pos, name, shape = ("unit" if p.sharded else "persistent", p.unit, p.pos, p.fqn, p.shape)
            split = splits.get(name)
            full = Cut.of(shape, split).full_shape
            items.append(Item(key, source, unit, pos, name, TensorEntry(key, dtype or torch.float32, full), split))
        elif key in buffers:
            items.append(Item(key, "buffer", -1, -1, key, TensorEntry(key, value.dtype, tuple(value.shape))))
    rank = {"unit": 0, "persistent": 1, "buffer": 2}
    return sorted(items, key=lambda it: (rank[it.source], it.unit, it.pos))


def split_files(items: list[Item], max_shard_size: int | None) -> list[tuple[str, list[Item]]]:
    """HF file names and their items; a file breaks only between units (streaming granularity)."""
    if max_shard_size is None:
        return [(SINGLE_FILE, items)]
    files: list[list[Item]] = [[]]
    size, last_unit = 0, None
    for it in items:
        starts_unit = it.source == "unit" and it.unit != last_unit
        if starts_unit and files[-1] and size + _unit_bytes(items, it.unit) > max_shard_size:
            files.append([])
            size = 0
        files[-1].append(it)
        size += it.entry.nbytes
        last_unit = it.unit if it.source == "unit" else last_unit
    n = len(files)
    if n == 1:  # as save_pretrained: one shard is model.safetensors (no index is written for it)
        return [(SINGLE_FILE, items)]
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", f) for i, f in enumerate(files)]


def _unit_bytes(items: list[Item], unit: int) -> int:
    return sum(it.entry.nbytes for it in items if it.source == "unit" and it.unit == unit)


class Sink:
    """Rank 0's writers. After a write error it keeps going silently, so the unit AllGathers of the
    other ranks still line up; the error is raised by `finish`."""

    def __init__(self, tmp: Path, files: list[tuple[str, list[Item]]], metadata: dict[str, str]) -> None:
        self.tmp, self.files, self.metadata = tmp, files, metadata
        self.sizes: dict[str, int] = {}
        self.checksums: dict[str, dict[str, str]] = {}  # file -> key -> checksum ([Note: checkpoint checksums])
        self.error: Exception | None = None
        self._file = -1
        self._writer: SafetensorsWriter | None = None
        self._left = 0

    def write(self, key: str, make: Callable[[], torch.Tensor]) -> None:
        """Write the tensor `make()` returns. It is made here, inside the error capture: a cast or a
        reshape that fails on rank 0 must not take it out of the unit AllGathers its peers are in."""
        if self.error is not None:
            return
        try:
            tensor = make()
            if self._left == 0:
                self._open_next()
            if self._writer is None:
                raise AssertionError("no open export file")
            self._writer.write(key, tensor)
            self._left -= 1
            if self._left == 0:
                self._close()
        except Exception as e:
            self.error = e
            if self._writer is not None:
                self._writer.abandon()
                self._writer = None

    def _open_next(self) -> None:
        self._file += 1
        name, items = self.files[self._file]
        self._writer = SafetensorsWriter(self.tmp / name, [it.entry for it in items], self.metadata)
        self._left = len(items)
        if not items:
            self._close()

    def _close(self) -> None:
        if self._writer is None:
            raise AssertionError("no open export file")
        name = self.files[self._file][0]
        self.sizes[name] = self._writer.close()
        self.checksums[name] = self._writer.checksums
        self._writer = None

    def end_unit(self) -> None:
        """A unit's tensors are all written: wait for their checksums, which hold the unit's buffer."""
        if self._writer is not None and self.error is None:
            try:
                self._writer.settle()
            except Exception as e:  # a bug in hashing; raised by finish(), like a write error
                self.error = e

    def finish(self) -> dict[str, int]:
        if self.error is not None:
            raise self.error
        while self._file + 1 < len(self.files):  # files with no items (a model without parameters)
            self._open_next()
        return self.sizes


def stream_units(model: DistributedModel, items: list[Item], sink: Sink | None, tp: TPComm | None) -> None:
    """Replica 0's sharding groups: AllGather unit by unit; the TP group of rank 0 (`tp`; None without
    tensor parallelism and on the other ranks) then AllGathers it over TP; rank 0 (`sink`) writes."""
    by_unit: dict[int, list[Item]] = {}
    for it in items:
        by_unit.setdefault(it.unit, []).append(it)
    state = model.sharded_state
    at = {(p.unit, p.pos): p for p in state.pieces}  # a persistent parameter's unit is -1
    for index in range(state.num_units):
        full = state.gather_unit(index)
        if full is None:
            continue
        per_tp = _over_tp(full, tp)
        if sink is not None:
            for it in by_unit.get(index, []):
                piece = at[(index, it.pos)]
                sink.write(it.key, partial(_original, it, per_tp, piece.offset, piece.shape))
            sink.end_unit()  # the checksums' references to this unit's buffer are gone
        del full, per_tp  # [memory] one unit's full parameters (times tp) at a time
    if sink is None and tp is None:
        return
    persistent = _over_tp(state.persistent_main(), tp)
    if sink is None:
        return
    buffers = persistent_buffers(model)
    for it in items:
        if it.source == "persistent":
            piece = at[(-1, it.pos)]
            sink.write(it.key, partial(_original, it, persistent, piece.offset, piece.shape))
        elif it.source == "buffer":
            sink.write(it.key, partial(buffers.__getitem__, it.name))


def _over_tp(flat: torch.Tensor, tp: TPComm | None) -> torch.Tensor:
    """[tp, n]: every TP rank's `flat`, in TP-rank order ([1, n] without TP). The TP ranks' units have
    identical layouts (equal local shapes), so one AllGather moves a whole unit."""
    if tp is None or flat.numel() == 0:
        return flat.unsqueeze(0)
    return tp.all_gather_stack(flat)


def _original(it: Item, per_tp: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Item `it` in the Hugging Face layout from its TP ranks' local values at `offset` of `per_tp`."""
    numel = math.prod(shape)
    local = [row[offset : offset + numel].view(shape) for row in per_tp]
    value = local[0] if it.split is None else it.split.full_of(local)  # replicated: TP rank 0's copy
    return value.to(it.entry.dtype)


def write_hf_config(module: nn.Module, directory: Path, dtype: torch.dtype) -> None:
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config = copy.deepcopy(config)
    config.architectures = [type(module).__name__]
    config.dtype = str(dtype).split(".")[1]
    config.save_pretrained(directory)
    can_generate = getattr(module, "can_generate", lambda: False)
    generation = getattr(module, "generation_config", None)
    if generation is not None and can_generate():
        generation.save_pretrained(directory)


def manifest(tag: str, checkpoint_id: str, sink: Sink, user_content: Any, model: DistributedModel) -> Any:
    return {
        "format": FULL_FORMAT,
        "version": ix.VERSION,
        "tag": tag,
        "checkpoint_id": checkpoint_id,
        "saved_at_ns": time.time_ns(),
        "num_backward": model.window.num_backward,
        "files": {n: {"bytes": b, "checksums": sink.checksums[n]} for n, b in sink.sizes.items()},
        "user_content": user_content,
    }


def hf_index(files: list[tuple[str, list[Item]]]) -> dict[str, Any]:
    total = sum(it.entry.nbytes for _, items in files for it in items)
    return {
        "metadata": {"total_size": total},
        "weight_map": {it.key: name for name, items in files for it in items},
    }
