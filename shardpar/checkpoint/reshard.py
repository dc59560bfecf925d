"""Partial checkpoints, the load side: check everything, then reshard into the current topology.

Each rank reads, for each of *its* slices under the current layout, the overlapping ranges of the
saved pieces (index.overlaps) -- a checkpoint saved on world 4 / sdp 2 resumes on world 2, sdp 4 or
a single process with no offline conversion, and every rank reads only the bytes it keeps. A change
of tensor-parallel degree (tp 2 -> 1, 1 -> 2, 2 -> 4, ...) goes through full-parameter coordinates
(placement.plan_fetch, [Note: full-parameter coordinates]): the slice is a set of runs of the
writers' TP-local pieces, each read where it lies.

    a parameter of 169 elements filling one unit:
    saved (sdp 2):    | piece of rank 0: [0, 85)    | piece of rank 1: [85, 169)      |
    resumed (sdp 4):  | r0: [0, 43) | r1: [43, 86)  | r2: [86, 129) | r3: [129, 169)  |
                                      reads [43, 85) from piece 0 and [85, 86) from piece 1
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from shardpar.checkpoint import fingerprint
from shardpar.checkpoint import index as ix
from shardpar.checkpoint.owned_state import PREFIX as OWNED
from shardpar.checkpoint.owned_state import load_owned, owned_files
from shardpar.checkpoint.partial import writes
from shardpar.checkpoint.pieces import Slot, buffer_shape_problems, fqn_of_piece, persistent_buffers, piece_of, slots
from shardpar.checkpoint.placement import Cut, Segment, assemble, plan_fetch, reads
from shardpar.checkpoint.safetensors_io import CheckpointError, check_file, dtype_of, misfit, verify_share
from shardpar.optim.loss_scaling import ScalerResume
from shardpar.optim.optimizer import DistributedOptimizer
from shardpar.runtime.model import DistributedModel
from shardpar.runtime.sharded_tensor import ShardedTensor


class Reader:
    """Reads flat element ranges of saved parameters and optimizer state, opening each file once."""

    def __init__(self, directory: Path, index: dict[str, Any]) -> None:
        self.directory = directory
        self.index = index
        self._stack = contextlib.ExitStack()
        self._open: dict[str, Any] = {}

    def _plan(self, fqn: str, cut: Cut, tp_rank: int, start: int, length: int) -> list[Segment]:
        return plan_fetch(ix.cut_of(self.index["params"][fqn]), cut, tp_rank, start, length)

    def files_for(self, fqn: str, cut: Cut, tp_rank: int, start: int, length: int) -> set[str]:
        """The files holding elements [start, start + length) of TP rank `tp_rank`'s parameter under `cut`."""
        pieces = ix.pieces_of(self.index, fqn)
        return {
            p.file
            for rank, lo, n, _ in reads(self._plan(fqn, cut, tp_rank, start, length))
            for p, _, _ in ix.overlaps(pieces, rank, lo, n)
        }

    def _handle(self, name: str) -> Any:
        if name not in self._open:
            self._open[name] = self._stack.enter_context(safe_open(self.directory / name, framework="pt"))
        return self._open[name]

    def read(
        self, prefix: str, fqn: str, cut: Cut, tp_rank: int, start: int, length: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Elements [start, start + length) of TP rank `tp_rank`'s flattened local `<prefix>/<fqn>` under
        `cut` (prefix "param" or "optim/<name>"), whatever cut the checkpoint was written with."""
        pieces = ix.pieces_of(self.index, fqn)

        def read_saved(saved_rank: int, lo: int, n: int) -> torch.Tensor:
            out = torch.empty(n, dtype=dtype)
            for piece, a, b in ix.overlaps(pieces, saved_rank, lo, n):
                out[a - lo : b - lo].copy_(
                    self._handle(piece.file).get_slice(f"{prefix}/{fqn}")[a - piece.start : b - piece.start]
                )
            return out

        return assemble(self._plan(fqn, cut, tp_rank, start, length), read_saved, length, dtype)

    def read_slot(self, prefix: str, s: Slot, dtype: torch.dtype) -> torch.Tensor:
        return self.read(prefix, s.fqn, s.cut, s.tp_rank, s.start, s.length, dtype)

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
    scaler_plan: ScalerResume | None = None  # set by check() when the optimizer's scaler is loaded

    @property
    def restores_rng(self) -> bool:
        """Rank i gets rank i's RNG state when (world, tp) is unchanged: then rank i has the same role."""
        saved_tp = int(self.index.get("topology", {}).get("tp", 1))
        if not self.index.get("rng"):  # none saved (`shardpar convert` writes none)
            return False
        return int(self.index["rng"]["world"]) == self.world and saved_tp == self.model.topology.plan.tp

    def check(self) -> fingerprint.RankHashes:
        """Everything that can fail, before anything is loaded (run on every rank, then agreed); this rank's
        hashes of the frozen base, for `verify_base` once every rank's are in."""
        self.index = ix.read_index(self.directory)
        if not self.model.all_sharded():
            raise ValueError("resume_from_checkpoint between training steps, not inside forward/backward")
        saved, mine = self.index["params"], {s.fqn: s for s in slots(self.model)}
        base = self.index.get("frozen", {})
        problems = [
            f"{fqn}: full shape {list(s.cut.full_shape)} in the model, {saved[fqn]['shape']} in the checkpoint"
            for fqn, s in mine.items()
            if fqn in saved and list(s.cut.full_shape) != saved[fqn]["shape"]
        ]
        buffers, saved_buffers = persistent_buffers(self.model), self.index["buffers"]
        problems += buffer_shape_problems(buffers, {b: entry["shape"] for b, entry in saved_buffers.items()})
        problems += fingerprint.shape_problems(base, mine.values())
        if self.strict:
            problems += [f"{f}: in the model, not in the checkpoint" for f in mine if f not in saved and f not in base]
            problems += [f"{f}: in the checkpoint, not in the model" for f in [*saved, *base] if f not in mine]
            problems += [f"buffer {b}: not in the checkpoint" for b in buffers if b not in saved_buffers]
            problems += [f"buffer {b}: in the checkpoint, not in the model" for b in saved_buffers if b not in buffers]
        if problems:
            raise misfit(self.directory, problems)
        if self.optimizer is not None and self.load_optimizer:
            self._check_optimizer()
            self._check_loss_scaler(self.optimizer)
        for name in sorted(self._needed_files()):
            check_file(
                self.directory / name,
                label=f"{self.directory}/{name}",
                expect_bytes=int(self.index["files"][name]["bytes"]),
                expect_tensors=ix.file_expectations(self.index, name),
                expect_metadata={"checkpoint_id": self.index["checkpoint_id"]},
            )
        recorded = ix.recorded_checksums(self.index, self._read_by_some_rank())
        verify_share(self.directory, recorded, rank=self.model.topology.rank, world=self.world)
        coords = self.model.topology.coords
        return fingerprint.rank_hashes((s, s.fqn in base and writes(s, coords)) for s in mine.values())

    def verify_base(self, reports: list[fingerprint.RankHashes]) -> None:
        """The frozen base the model holds against the checkpoint's fingerprint ([Note: adapter-only
        checkpoints]); every rank gets every rank's hashes, so all raise or none does."""
        mine = {s.fqn for s in slots(self.model)}
        base = {f: e for f, e in self.index.get("frozen", {}).items() if f in mine}
        fingerprint.verify(self.directory, base, reports)

    def _read_by_some_rank(self) -> Callable[[str], bool]:
        """Whether some rank's apply() reads tensor `key` (the same answer on every rank)."""
        fqns = {s.fqn for s in slots(self.model)} & set(self.index["params"])
        buffers = set(persistent_buffers(self.model))
        optimizer = self.optimizer is not None and self.load_optimizer

        def read(key: str) -> bool:
            kind, _, rest = key.partition("/")
            if kind == "param":
                return rest in fqns
            if kind in ("optim", OWNED):
                return optimizer and rest.partition("/")[2] in fqns
            if kind == "buffer":
                return rest in buffers
            return kind == "rng" and self.restores_rng

        return read

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

    def _check_loss_scaler(self, optimizer: DistributedOptimizer) -> None:
        """Decide now whether the saved scaler state applies ([Note: loss scaler on resume])."""
        saved = self.index.get("loss_scaler")
        if saved is None:
            return
        try:
            self.scaler_plan = optimizer.plan_loss_scaler_load(saved)
        except ValueError as e:
            raise CheckpointError(f"{self.directory}/{ix.INDEX_NAME}: {e}") from None

    def _needed_files(self) -> set[str]:
        reader = Reader(self.directory, self.index)
        needed = {
            self.index["buffers"][b]["file"] for b in persistent_buffers(self.model) if b in self.index["buffers"]
        }
        for s in slots(self.model):
            if s.fqn in self.index["params"]:
                needed |= reader.files_for(s.fqn, s.cut, s.tp_rank, s.start, s.length)
        if self.restores_rng:
            needed.add(self.index["rng"]["file"])
        if self.optimizer is not None and self.load_optimizer:
            needed |= owned_files(self.index, self.optimizer)
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
        return ix.decode(self.index["user_content"])

    def _load_model(self, reader: Reader) -> None:
        saved = self.index["params"]
        for s in slots(self.model):
            if s.fqn in saved and s.length:
                values = reader.read_slot("param", s, dtype_of(saved[s.fqn]["dtype"]))
                s.value.copy_(values.view(s.shape))
        for name, buf in persistent_buffers(self.model).items():
            if name in self.index["buffers"]:
                buf.copy_(reader.tensor(self.index["buffers"][name]["file"], ix.buffer_key(name)))
        self.model.sharded_state.refresh_compute()

    def _load_optimizer(self, reader: Reader, optimizer: DistributedOptimizer) -> None:
        saved = self.index["optimizer"]
        for group, entry in zip(optimizer.param_groups, saved["param_groups"], strict=True):
            group.update({k: v for k, v in ix.decode(entry["options"]).items() if k != "params"})
        state = optimizer.optimizer.state
        state.clear()
        whole = load_owned(reader.tensor, self.index, optimizer, state, f"{self.directory}: optimizer")
        for s in slots(self.model):
            meta, piece = saved["state"].get(s.fqn), piece_of(optimizer, s.param)
            if meta is None or piece is None or s.fqn in whole:
                continue
            if "tensors" not in meta:
                raise CheckpointError(
                    f"{self.directory}: optimizer: {s.fqn!r} was saved stepped whole by an owner and is stepped "
                    "piecewise now; resume with the optimizer it was saved with"
                )
            entry = {k: ix.decode(v, device=piece.device) for k, v in meta["scalars"].items()}
            for k, dtype in meta["tensors"].items():
                flat = reader.read_slot(f"optim/{k}", s, dtype_of(dtype))
                entry[k] = flat.view(s.shape).to(piece.device)
                if isinstance(piece, ShardedTensor):  # an optimizer stepping the user parameters
                    entry[k] = ShardedTensor(entry[k], piece.shard_layout)
            state[piece] = entry
        if self.scaler_plan is not None:
            optimizer.load_loss_scaler_state(self.index["loss_scaler"], self.scaler_plan)

    def _load_rng(self, reader: Reader) -> None:
        rank, name = self.model.topology.rank, self.index["rng"]["file"]
        torch.set_rng_state(reader.tensor(name, ix.rng_key("torch", rank)))
        cuda_key = ix.rng_key("cuda", rank)
        if torch.cuda.is_available() and cuda_key in self.index["files"][name]["tensors"]:
            torch.cuda.set_rng_state(reader.tensor(name, cuda_key))


def consolidated(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Offline: every parameter and buffer of a partial checkpoint at full shape (one at a time);
    TP-split parameters are consolidated to the Hugging Face layout."""
    index = ix.read_index(directory)
    reader = Reader(directory, index)
    try:
        for fqn, entry in index["params"].items():
            whole = Cut(tuple(int(d) for d in entry["shape"]))
            flat = reader.read("param", fqn, whole, 0, 0, whole.numel, dtype_of(entry["dtype"]))
            yield fqn, flat.view(whole.full_shape)
        for name, entry in index["buffers"].items():
            yield name, reader.tensor(entry["file"], ix.buffer_key(name))
    finally:
        reader.close()
