"""Partial checkpoints, the load side: check everything, then reshard into the current topology.

Each rank reads, for each of *its* slices under the current layout, the overlapping ranges of the
saved pieces (index.overlaps) -- a checkpoint saved on world 4 / sdp 2 resumes on world 2, sdp 4 or
a single process with no offline conversion, and every rank reads only the bytes it keeps:

    a parameter of 169 elements filling one unit:
    saved (sdp 2):    | piece of rank 0: [0, 85)    | piece of rank 1: [85, 169)      |
    resumed (sdp 4):  | r0: [0, 43) | r1: [43, 86)  | r2: [86, 129) | r3: [129, 169)  |
                                      reads [43, 85) from piece 0 and [85, 86) from piece 1
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from shardpar.checkpoint import index as ix
from shardpar.checkpoint.pieces import fqn_of_piece, persistent_buffers, piece_of, slots
from shardpar.checkpoint.safetensors_io import CheckpointError, check_file, dtype_of, misfit
from shardpar.model import DistributedModel
from shardpar.optimizer import DistributedOptimizer


class Reader:
    """Reads flat element ranges of saved parameters and optimizer state, opening each file once."""

    def __init__(self, directory: Path, index: dict[str, Any]) -> None:
        self.directory = directory
        self.index = index
        self._stack = contextlib.ExitStack()
        self._open: dict[str, Any] = {}

    def files_for(self, fqn: str, start: int, length: int) -> set[str]:
        return {p.file for p, _, _ in ix.overlaps(ix.pieces_of(self.index, fqn), start, length)}

    def _handle(self, name: str) -> Any:
        if name not in self._open:
            self._open[name] = self._stack.enter_context(safe_open(self.directory / name, framework="pt"))
        return self._open[name]

    def read(self, prefix: str, fqn: str, start: int, length: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements [start, start + length) of `<prefix>/<fqn>` (prefix "param" or "optim/<name>")."""
        out = torch.empty(length, dtype=dtype)
        for piece, lo, hi in ix.overlaps(ix.pieces_of(self.index, fqn), start, length):
            part = self._handle(piece.file).get_slice(f"{prefix}/{fqn}")[lo - piece.start : hi - piece.start]
            out[lo - start : hi - start].copy_(part)
        return out

    def tensor(self, name: str, key: str) -> torch.Tensor:
        return self._handle(name).get_tensor(key)

    def close(self) -> None:
        self._stack.close()


@dataclass
class LoadJob:
    directory: Path
    model: DistributedModel
    optimizer: DistributedOptimizer | None
    strict: bool
    load_optimizer: bool
    world: int
    index: dict[str, Any] = field(default_factory=dict)

    @property
    def restores_rng(self) -> bool:
        return int(self.index["rng"]["world"]) == self.world

    def check(self) -> None:
        """Everything that can fail, before anything is loaded (run on every rank, then agreed)."""
        self.index = ix.read_index(self.directory)
        if not self.model.all_sharded():
            raise ValueError("resume_from_checkpoint between training steps, not inside forward/backward")
        saved, mine = self.index["params"], {s.fqn: s for s in slots(self.model)}
        problems = [
            f"{fqn}: shape {list(s.full_shape)} in the model, {saved[fqn]['shape']} in the checkpoint"
            for fqn, s in mine.items()
            if fqn in saved and list(s.full_shape) != saved[fqn]["shape"]
        ]
        if self.strict:
            problems += [f"{f}: in the model, not in the checkpoint" for f in mine if f not in saved]
            problems += [f"{f}: in the checkpoint, not in the model" for f in saved if f not in mine]
            buffers = persistent_buffers(self.model)
            problems += [f"buffer {b}: not in the checkpoint" for b in buffers if b not in self.index["buffers"]]
        if problems:
            raise misfit(self.directory, problems)
        if self.optimizer is not None and self.load_optimizer:
            self._check_optimizer()
        for name in sorted(self._needed_files()):
            check_file(
                self.directory / name,
                label=f"{self.directory}/{name}",
                expect_bytes=int(self.index["files"][name]["bytes"]),
                expect_tensors=ix.file_expectations(self.index, name),
                expect_metadata={"checkpoint_id": self.index["checkpoint_id"]},
            )

    def _check_optimizer(self) -> None:
        if self.optimizer is None:
            return
        saved = self.index.get("optimizer")
        where = f"{self.directory}: optimizer"
        if saved is None:
            raise CheckpointError(f"{where}: the checkpoint holds no optimizer state; pass load_optimizer=False")
        mine = type(self.optimizer.optimizer).__name__
        if saved["class"] != mine:
            raise CheckpointError(f"{where}: saved from {saved['class']}, loading into {mine}")
        fqn_of = fqn_of_piece(self.model, self.optimizer)
        now = [{fqn_of[id(p)] for p in g["params"]} for g in self.optimizer.param_groups]
        then = [set(g["params"]) for g in saved["param_groups"]]
        if len(now) != len(then):
            raise CheckpointError(f"{where}: {len(then)} param groups saved, the optimizer has {len(now)}")
        for i, (a, b) in enumerate(zip(now, then, strict=True)):
            if a != b:
                diff = sorted(a ^ b)
                raise CheckpointError(f"{where}: param group {i} differs ({len(diff)} parameters, e.g. {diff[0]!r})")

    def _needed_files(self) -> set[str]:
        reader = Reader(self.directory, self.index)
        needed = {
            self.index["buffers"][b]["file"] for b in persistent_buffers(self.model) if b in self.index["buffers"]
        }
        for s in slots(self.model):
            if s.fqn in self.index["params"]:
                needed |= reader.files_for(s.fqn, s.start, s.length)
        if self.restores_rng:
            needed.add(self.index["rng"]["file"])
        return needed

    def apply(self) -> Any:
        reader = Reader(self.directory, self.index)
        try:
            with torch.no_grad():
                self._load_model(reader)
                if self.optimizer is not None and self.load_optimizer:
                    self._load_optimizer(reader, self.optimizer)
            if self.restores_rng:
                self._load_rng(reader)
        finally:
            reader.close()
        self.model.num_backward = int(self.index["num_backward"])
        return ix.decode(self.index["user_content"])

    def _load_model(self, reader: Reader) -> None:
        saved = self.index["params"]
        for s in slots(self.model):
            if s.fqn in saved and s.length:
                values = reader.read("param", s.fqn, s.start, s.length, dtype_of(saved[s.fqn]["dtype"]))
                s.value.copy_(values.view(s.shape))
        for name, buf in persistent_buffers(self.model).items():
            if name in self.index["buffers"]:
                buf.copy_(reader.tensor(self.index["buffers"][name]["file"], ix.buffer_key(name)))
        for unit in self.model.units:
            unit.refresh_compute()
        self.model.persistent.refresh_compute()

    def _load_optimizer(self, reader: Reader, optimizer: DistributedOptimizer) -> None:
        saved = self.index["optimizer"]
        for group, entry in zip(optimizer.param_groups, saved["param_groups"], strict=True):
            group.update({k: v for k, v in ix.decode(entry["options"]).items() if k != "params"})
        state = optimizer.optimizer.state
        state.clear()
        for s in slots(self.model):
            meta, piece = saved["state"].get(s.fqn), piece_of(optimizer, s.param)
            if meta is None or piece is None:
                continue
            entry = {k: ix.decode(v, device=piece.device) for k, v in meta["scalars"].items()}
            for k, dtype in meta["tensors"].items():
                flat = reader.read(f"optim/{k}", s.fqn, s.start, s.length, dtype_of(dtype))
                entry[k] = flat.view(s.shape).to(piece.device)
            state[piece] = entry
        scaler, scaler_state = getattr(optimizer, "loss_scaler", None), self.index.get("loss_scaler")
        if scaler is not None and scaler_state is not None and hasattr(scaler, "load_state_dict"):
            scaler.load_state_dict(scaler_state)
            if hasattr(scaler, "loss_scale"):
                self.model.loss_scale = float(scaler.loss_scale)  # what model.backward multiplies by

    def _load_rng(self, reader: Reader) -> None:
        rank, name = self.model.topology.rank, self.index["rng"]["file"]
        torch.set_rng_state(reader.tensor(name, ix.rng_key("torch", rank)))
        cuda_key = ix.rng_key("cuda", rank)
        if torch.cuda.is_available() and cuda_key in self.index["files"][name]["tensors"]:
            torch.cuda.set_rng_state(reader.tensor(name, cuda_key))


def consolidated(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Offline: every parameter and buffer of a partial checkpoint at full shape (one at a time)."""
    index = ix.read_index(directory)
    reader = Reader(directory, index)
    try:
        for fqn, entry in index["params"].items():
            numel = ix.numel_of(entry["shape"])
            flat = reader.read("param", fqn, 0, numel, dtype_of(entry["dtype"]))
            yield fqn, flat.view(entry["shape"])
        for name, entry in index["buffers"].items():
            yield name, reader.tensor(entry["file"], ix.buffer_key(name))
    finally:
        reader.close()
