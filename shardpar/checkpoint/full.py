"""Full checkpoints: the consolidated model as a Hugging Face directory, streamed unit by unit.

    <tag>/
        config.json, generation_config.json     (a PreTrainedModel with translate_if_full=True)
        model.safetensors                       one file, or with max_shard_size:
        model-00001-of-0000N.safetensors ...    + model.safetensors.index.json (HF's sharded layout)
        shardpar_full.json                      manifest: file sizes, checkpoint id, user_content

Only replica 0's sharding group works: it AllGathers one unit at a time (fp32 main shards) and
rank 0 writes that unit's tensors straight into the pre-computed safetensors layout, so no rank ever
holds more than one unit's full parameters. Keys are the unwrapped model's state_dict keys, with
tied aliases dropped the way `save_pretrained` drops them, so `from_pretrained(dir)` reports no
missing keys. Optimizer state is not part of a full checkpoint (use partial=True to resume training).
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from shardpar.checkpoint import index as ix
from shardpar.checkpoint.pieces import persistent_buffers, slots
from shardpar.checkpoint.safetensors_io import (
    CheckpointError,
    SafetensorsWriter,
    TensorEntry,
    check_file,
    misfit,
    read_header,
)
from shardpar.model import DistributedModel

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
    entry: TensorEntry


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
    where: dict[int, tuple[str, int, int, str, tuple[int, ...]]] = {}
    for u in model.units:
        for j, (p, spec) in enumerate(zip(u.params, u.layout.specs, strict=True)):
            where[id(p)] = ("unit", u.index, j, spec.fqn, spec.shape)
    for i, (name, p) in enumerate(model.persistent.named):
        where[id(p)] = ("persistent", -1, i, name, tuple(p.shape))
    buffers = persistent_buffers(model)
    items = []
    for key, value in export_keys(model.module).items():
        if id(value) in where:
            source, unit, pos, name, shape = where[id(value)]
            items.append(Item(key, source, unit, pos, name, TensorEntry(key, dtype or torch.float32, shape)))
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
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", f) for i, f in enumerate(files)]


def _unit_bytes(items: list[Item], unit: int) -> int:
    return sum(it.entry.nbytes for it in items if it.source == "unit" and it.unit == unit)


class Sink:
    """Rank 0's writers. After a write error it keeps going silently, so the unit AllGathers of the
    other ranks still line up; the error is raised by `finish`."""

    def __init__(self, tmp: Path, files: list[tuple[str, list[Item]]], metadata: dict[str, str]) -> None:
        self.tmp, self.files, self.metadata = tmp, files, metadata
        self.sizes: dict[str, int] = {}
        self.error: Exception | None = None
        self._file = -1
        self._writer: SafetensorsWriter | None = None
        self._left = 0

    def write(self, key: str, tensor: torch.Tensor) -> None:
        if self.error is not None:
            return
        try:
            if self._left == 0:
                self._open_next()
            if self._writer is None:
                raise AssertionError("no open export file")
            self._writer.write(key, tensor)
            self._left -= 1
            if self._left == 0:
                self.sizes[self.files[self._file][0]] = self._writer.close()
                self._writer = None
        except Exception as e:
            self.error = e

    def _open_next(self) -> None:
        self._file += 1
        name, items = self.files[self._file]
        self._writer = SafetensorsWriter(self.tmp / name, [it.entry for it in items], self.metadata)
        self._left = len(items)
        if not items:
            self.sizes[name] = self._writer.close()
            self._writer = None

    def finish(self) -> dict[str, int]:
        if self.error is not None:
            raise self.error
        while self._file + 1 < len(self.files):  # files with no items (a model without parameters)
            self._open_next()
        return self.sizes


def stream_units(model: DistributedModel, items: list[Item], sink: Sink | None) -> None:
    """Replica 0's sharding group: AllGather unit by unit; rank 0 (`sink`) writes as it goes."""
    by_unit: dict[int, list[Item]] = {}
    for it in items:
        by_unit.setdefault(it.unit, []).append(it)
    for unit in model.units:
        if unit.layout.numel == 0:
            continue
        full = torch.empty(unit.layout.padded_numel, dtype=torch.float32, device=unit.device)
        model.engine.all_gather(full, unit.main_shard, unit.comm.sharding)
        if sink is not None:
            for it in by_unit.get(unit.index, []):
                spec = unit.layout.specs[it.pos]
                sink.write(it.key, full[spec.offset : spec.offset + spec.numel].view(spec.shape).to(it.entry.dtype))
        del full  # [memory] one unit's full parameters at a time
    if sink is None:
        return
    buffers = persistent_buffers(model)
    for it in items:
        if it.source == "persistent":
            sink.write(it.key, model.persistent.main_view(it.pos).to(it.entry.dtype))
        elif it.source == "buffer":
            sink.write(it.key, buffers[it.name])


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


def manifest(tag: str, checkpoint_id: str, sizes: dict[str, int], user_content: Any, model: DistributedModel) -> Any:
    return {
        "format": FULL_FORMAT,
        "version": ix.VERSION,
        "tag": tag,
        "checkpoint_id": checkpoint_id,
        "saved_at_ns": time.time_ns(),
        "num_backward": model.num_backward,
        "files": {n: {"bytes": b} for n, b in sizes.items()},
        "user_content": user_content,
    }


def hf_index(files: list[tuple[str, list[Item]]]) -> dict[str, Any]:
    total = sum(it.entry.nbytes for _, items in files for it in items)
    return {
        "metadata": {"total_size": total},
        "weight_map": {it.key: name for name, items in files for it in items},
    }


# ---- load -----------------------------------------------------------------------------------------


@dataclass
class FullLoad:
    directory: Path
    model: DistributedModel
    strict: bool
    where: dict[str, str]  # state_dict key -> file name
    user_content: Any = None
    num_backward: int | None = None

    @classmethod
    def check(cls, directory: Path, model: DistributedModel, strict: bool) -> FullLoad:
        """Validate the directory against its manifest and the model; nothing is loaded here."""
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: checkpoint directory is missing")
        info = _read_manifest(directory)
        names = _weight_files(directory)
        if info and set(info["files"]) != set(names):
            odd = sorted(set(info["files"]) ^ set(names))
            raise CheckpointError(f"{directory}: the manifest and the weight files disagree about {odd}")
        where: dict[str, str] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for name in names:
            label = f"{directory}/{name}"
            recorded = info["files"].get(name, {}).get("bytes") if info else None
            meta = {"checkpoint_id": info["checkpoint_id"]} if info else {}
            check_file(directory / name, label=label, expect_bytes=recorded, expect_tensors={}, expect_metadata=meta)
            for key, (_, shape) in read_header(directory / name, label=label).tensors.items():
                where[key], shapes[key] = name, shape
        load = cls(directory, model, strict, where)
        load._match(shapes)
        if info:
            load.user_content = ix.decode(info["user_content"])
            load.num_backward = info.get("num_backward")
        return load

    def _aliases(self) -> Iterator[tuple[Any, list[str], tuple[int, ...]]]:
        names: dict[int, list[str]] = {}
        for n, p in self.model.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        for s in slots(self.model):
            yield s, names[id(s.param)], s.full_shape

    def key_of(self, aliases: list[str]) -> str | None:
        return next((a for a in aliases if a in self.where), None)

    def _match(self, shapes: dict[str, tuple[int, ...]]) -> None:
        problems: list[str] = []
        used: set[str] = set()
        for _, aliases, shape in self._aliases():
            key = self.key_of(aliases)
            if key is None:
                if self.strict:
                    problems.append(f"{aliases[0]}: in the model, not in the checkpoint")
                continue
            used.update(a for a in aliases if a in self.where)
            if shapes[key] != shape:
                problems.append(f"{key}: shape {list(shape)} in the model, {list(shapes[key])} in the checkpoint")
        buffers = persistent_buffers(self.model)
        used.update(b for b in buffers if b in self.where)
        if self.strict:
            problems += [f"buffer {b}: not in the checkpoint" for b in buffers if b not in self.where]
            problems += [f"{k}: in the checkpoint, not in the model" for k in self.where if k not in used]
        if problems:
            raise misfit(self.directory, problems)

    def apply(self) -> Any:
        with torch.no_grad(), _Files(self.directory) as files:
            for s, aliases, _ in self._aliases():
                key = self.key_of(aliases)
                if key is not None and s.length:
                    s.value.copy_(_read_flat(files.get(self.where[key]), key, s.start, s.length).view(s.shape))
            for name, buf in persistent_buffers(self.model).items():
                if name in self.where:
                    buf.copy_(files.get(self.where[name]).get_tensor(name))
        for unit in self.model.units:
            unit.refresh_compute()
        self.model.persistent.refresh_compute()
        if self.num_backward is not None:
            self.model.num_backward = int(self.num_backward)
        return self.user_content


class _Files(contextlib.ExitStack):
    """safetensors handles of a directory, each opened once, all closed on exit."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory
        self._open: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        if name not in self._open:
            self._open[name] = self.enter_context(safe_open(self.directory / name, framework="pt"))
        return self._open[name]


def _read_flat(handle: Any, key: str, start: int, length: int) -> torch.Tensor:
    """Flat elements [start, start + length) of a saved tensor, reading only the rows that hold them."""
    sl = handle.get_slice(key)
    shape = sl.get_shape()
    if len(shape) <= 1:
        part = sl[start : start + length] if shape else handle.get_tensor(key)
        return part.reshape(-1).float()
    row = 1
    for d in shape[1:]:
        row *= d
    first, last = start // row, -(-(start + length) // row)
    rows = sl[first:last].reshape(-1)
    return rows[start - first * row : start - first * row + length].float()


def _read_manifest(directory: Path) -> dict[str, Any] | None:
    path = directory / MANIFEST
    if not path.is_file():
        return None  # a plain Hugging Face directory: checked by its headers only
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); the file is truncated or corrupt") from None
    if not isinstance(info, dict) or info.get("format") != FULL_FORMAT:
        raise CheckpointError(f"{path}: not a shardpar full checkpoint manifest")
    return info


def _weight_files(directory: Path) -> list[str]:
    index_path = directory / HF_INDEX
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: corrupt index ({e})") from None
        return sorted(set(weight_map.values()))
    if (directory / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    raise CheckpointError(f"{directory}: neither {SINGLE_FILE} nor {HF_INDEX} is present")
