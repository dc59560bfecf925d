"""Full checkpoints, the load side: a Hugging Face directory (a shardpar export or a plain
`save_pretrained` one) into the current model, whatever its topology.

Everything is checked first (files against the manifest when there is one, headers, names and full
shapes against the model); then each rank reads only its slices. Under tensor parallelism a slice
of a TP-local parameter is a set of runs of the Hugging Face tensor (placement.plan_fetch); a run
inside one row (row-parallel weights) reads just that part of the row.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from shardpar.checkpoint import index as ix
from shardpar.checkpoint.full import FULL_FORMAT, HF_INDEX, MANIFEST, SINGLE_FILE
from shardpar.checkpoint.pieces import Slot, buffer_shape_problems, persistent_buffers, slots
from shardpar.checkpoint.placement import Cut, assemble, plan_fetch
from shardpar.checkpoint.safetensors_io import (
    CheckpointError,
    check_file,
    misfit,
    read_header,
    tensor_nbytes,
    verify_share,
)
from shardpar.runtime.model import DistributedModel
from shardpar.runtime.state_dict import param_aliases


@dataclass
class FullLoad:
    directory: Path
    model: DistributedModel
    strict: bool
    where: dict[str, str]  # state_dict key -> file name
    user_content: Any = None

    @classmethod
    def check(cls, directory: Path, model: DistributedModel, strict: bool) -> FullLoad:
        """Validate the directory against its manifest and the model; nothing is loaded here."""
        ix.require_directory(directory)
        info = _read_manifest(directory)
        names = _weight_files(directory)
        if info and set(info["files"]) != set(names):
            odd = sorted(set(info["files"]) ^ set(names))
            raise CheckpointError(f"{directory}: the manifest and the weight files disagree about {odd}")
        where: dict[str, str] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        tables: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
        for name in names:
            label = f"{directory}/{name}"
            recorded = info["files"].get(name, {}).get("bytes") if info else None
            meta = {"checkpoint_id": info["checkpoint_id"]} if info else {}
            check_file(directory / name, label=label, expect_bytes=recorded, expect_tensors={}, expect_metadata=meta)
            tables[name] = read_header(directory / name, label=label).tensors
            for key, (_, shape) in tables[name].items():
                where[key], shapes[key] = name, shape
        load = cls(directory, model, strict, where)
        load._match(shapes)
        if info:
            load._verify(info, tables)
            load.user_content = ix.decode(info["user_content"])
        return load

    def _verify(self, info: dict[str, Any], tables: dict[str, dict[str, tuple[str, tuple[int, ...]]]]) -> None:
        """This rank's share of the checksums of the tensors apply() reads ([Note: checkpoint checksums])."""
        read = {k for _, aliases, _ in self._aliases() if (k := self.key_of(aliases)) is not None}
        read |= {b for b in persistent_buffers(self.model) if b in self.where}
        recorded: dict[str, dict[str, tuple[str, int]]] = {}
        for name, table in tables.items():
            sums = info["files"][name].get("checksums")
            if sums is None:
                continue  # written before checksums: loads unverified
            odd = sorted(set(sums) ^ set(table)) if isinstance(sums, dict) else ["(not a table)"]
            if odd:
                raise CheckpointError(
                    f"{self.directory}/{MANIFEST}: the checksums of {name} and its tensors disagree about "
                    f"{len(odd)} keys, e.g. {odd[0]!r}"
                )
            keys = {k: (str(sums[k]), tensor_nbytes(*table[k])) for k in table if k in read}
            recorded[name] = keys
        topology = self.model.topology
        verify_share(self.directory, recorded, rank=topology.rank, world=topology.plan.world)

    def _aliases(self) -> Iterator[tuple[Any, list[str], tuple[int, ...]]]:
        names, state = param_aliases(self.model.module), self.model.sharded_state
        for s in slots(self.model):
            yield s, names[id(state.user_of(state.piece_of(s.param) or _missing(s.fqn)))], s.cut.full_shape

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
        problems += buffer_shape_problems(buffers, shapes)
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
                    s.value.copy_(_read_slot(files.get(self.where[key]), key, s).view(s.shape))
            for name, buf in persistent_buffers(self.model).items():
                if name in self.where:
                    buf.copy_(files.get(self.where[name]).get_tensor(name))
        self.model.sharded_state.refresh_compute()
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


def _read_slot(handle: Any, key: str, s: Slot) -> torch.Tensor:
    """Slot `s`'s elements of its TP-local parameter, from the full (Hugging Face) tensor `key`."""
    sl = handle.get_slice(key)
    shape = list(sl.get_shape())
    if not shape:
        return handle.get_tensor(key).reshape(-1).float()

    def read(_: int, start: int, length: int) -> torch.Tensor:
        return _read_flat(sl, shape, start, length)

    segments = plan_fetch(Cut(s.cut.full_shape), s.cut, s.tp_rank, s.start, s.length)
    return assemble(segments, read, s.length, torch.float32)


def _read_flat(sl: Any, shape: list[int], start: int, length: int) -> torch.Tensor:
    """Flat elements [start, start + length) (length >= 1) of a saved tensor of `shape` (>= 1 dim),
    reading only the rows that hold them: leading indices shared by the first and the last element
    are fixed, so a run inside one row of a row-parallel weight reads just that run."""
    index: list[slice] = []
    for d in range(len(shape)):
        inner = math.prod(shape[d + 1 :])
        first, last = start // inner, (start + length - 1) // inner
        if first != last or d == len(shape) - 1:
            index.append(slice(first, last + 1))
            skip = start - first * inner
            return sl[tuple(index)].reshape(-1)[skip : skip + length].float()
        index.append(slice(first, first + 1))
        start -= first * inner
    raise AssertionError("unreachable: the last dim always returns")


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


def _missing(fqn: str) -> Any:
    raise AssertionError(f"{fqn}: a checkpoint slot without a piece in the sharded state")
