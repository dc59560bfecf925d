"""Partial checkpoints, the save side: every shard written exactly once (see index.py for the layout).

Ranks of replica 0 write their pieces of every sharded parameter (fp32 main shard) and the optimizer
state of those elements -- with shard_optimizer_state every rank writes its own piece of its shard,
which no other rank holds; the first sharding group (rdp rank 0) adds the persistent parameters, rank 0
the buffers and every rank's RNG state; the other replicas write nothing. With tensor parallelism
every TP rank writes its pieces of the TP-split parameters (local pieces, placed in the full
parameter by the index's `tp` cut) and only TP rank 0 those of TP-replicated ones, which are equal
on every TP rank. Optimizer state is keyed by parameter FQN, never by position:
per-element tensors (Adam's exp_avg, exp_avg_sq, SGD's momentum_buffer, ...) are cut like the
parameter, scalars (`step`) go to the JSON. Parameters that do not train are not written: the writers
hash their pieces instead and the index records the frozen base's fingerprint ([Note: adapter-only
checkpoints] in fingerprint.py). Loading is reshard.py.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardpar.checkpoint import atomic, fingerprint
from shardpar.checkpoint import index as ix
from shardpar.checkpoint.owned_state import collect_owned
from shardpar.checkpoint.pieces import Slot, fqn_of_piece, persistent_buffers, piece_of, slots, split_state
from shardpar.checkpoint.safetensors_io import CheckpointError, dtype_name, write_tensors
from shardpar.optim.optimizer import DistributedOptimizer
from shardpar.runtime.model import DistributedModel
from shardpar.topology import RankCoords


def _rng_report() -> dict[str, bytes | None]:
    cuda = torch.cuda.get_rng_state().numpy().tobytes() if torch.cuda.is_available() else None
    return {"torch": torch.get_rng_state().numpy().tobytes(), "cuda": cuda}


def writes(slot: Slot, coords: RankCoords) -> bool:
    """Whether this rank writes `slot`: exactly one rank holds each (TP rank, element) in a checkpoint."""
    if not slot.tp_split and coords.tp_rank != 0:
        return False  # TP-replicated: TP rank 0's copy
    if slot.sharded:
        return coords.replica == 0 or slot.replica_owned
    return coords.rdp_rank == 0


def prime_fingerprint(model: DistributedModel) -> None:
    """Hash this rank's pieces of the frozen base now (at wrap), so that adapter-only saves reuse the
    CRCs while the base is unchanged ([Note: fingerprint cache] in fingerprint.py)."""
    coords = model.topology.coords
    fingerprint.rank_hashes(((s, s.private and writes(s, coords)) for s in slots(model)), reuse=True)


def write_rank_file(
    tmp: Path, checkpoint_id: str, model: DistributedModel, optimizer: DistributedOptimizer | None
) -> dict[str, Any]:
    """Write this rank's file (writers only, see `writes`); a JSON-able report for the index."""
    tensors, report = collect_rank_file(model, optimizer)
    return write_collected(tmp, checkpoint_id, model.topology.coords.rank, tensors, report)


def collect_rank_file(
    model: DistributedModel, optimizer: DistributedOptimizer | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's tensors (views of the live ones, in file order) and its report without the file entry."""
    coords = model.topology.coords
    tensors: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[int]] = {}
    state_meta: dict[str, dict[str, Any]] = {}
    owned = {id(leaf) for _, leaf, _ in optimizer.owned_leaves()} if optimizer is not None else set()
    every = slots(model)
    frozen = fingerprint.rank_hashes(((s, writes(s, coords)) for s in every), reuse=True)
    for slot in every:
        if slot.frozen or not writes(slot, coords):
            continue
        piece = piece_of(optimizer, slot.param) if optimizer is not None else None
        if piece is not None and id(piece) in owned:
            piece = None  # held whole by its owner: collect_owned below
        state = optimizer.optimizer.state.get(piece) if optimizer is not None and piece is not None else None
        per_element, scalars = split_state(slot, state) if state else ({}, {})
        if state:
            state_meta[slot.fqn] = {
                "tensors": {k: dtype_name(v.dtype) for k, v in per_element.items()},
                "scalars": scalars,
            }
        if slot.length:
            pieces[slot.fqn] = [slot.start, slot.length, slot.tp_rank]
            tensors[ix.param_key(slot.fqn)] = slot.value.reshape(-1)
            for k, v in per_element.items():
                tensors[ix.state_key(k, slot.fqn)] = v.reshape(-1)
    if optimizer is not None:
        collect_owned(optimizer, coords, tensors, state_meta)
    if coords.rank == 0:
        for name, buf in persistent_buffers(model).items():
            tensors[ix.buffer_key(name)] = buf
    report = {"pieces": pieces, "state": state_meta, "frozen": frozen, "rng": _rng_report(), "file": None}
    return tensors, report


def write_collected(
    tmp: Path, checkpoint_id: str, rank: int, tensors: dict[str, torch.Tensor], report: dict[str, Any]
) -> dict[str, Any]:
    """Write `tensors` as this rank's file (nothing when empty); `report` with its file entry."""
    if tensors:
        name = ix.shard_file(rank)
        written = write_tensors(tmp / name, tensors, {"checkpoint_id": checkpoint_id, "format": "pt"})
        table = {k: [dtype_name(t.dtype), list(t.shape)] for k, t in tensors.items()}
        report["file"] = {"name": name, "bytes": written.bytes, "tensors": table, "checksums": written.checksums}
    return report


@dataclass
class SaveJob:
    root: Path
    tag: str
    tmp: Path
    checkpoint_id: str
    user_content: Any  # already encoded
    model: DistributedModel
    optimizer: DistributedOptimizer | None
    num_kept: int | None
    reports: list[dict[str, Any]] = field(default_factory=list)
    frozen: dict[str, Any] | None = None  # the index's model-side entries, taken by freeze()

    @property
    def final(self) -> Path:
        return self.root / f"{self.tag}{ix.PARTIAL_SUFFIX}"

    def commit(self) -> str:
        """Rank 0, after every rank wrote: RNG file, index, rename, `newest` pointer, pruning."""
        rng = {
            ix.rng_key(kind, r): torch.frombuffer(bytearray(data), dtype=torch.uint8)
            for r, rep in enumerate(self.reports)
            for kind, data in rep["rng"].items()
            if data is not None
        }
        files = {
            rep["file"]["name"]: {k: v for k, v in rep["file"].items() if k != "name"}
            for rep in self.reports
            if rep["file"]
        }
        written = write_tensors(self.tmp / ix.RNG_FILE, rng, {"checkpoint_id": self.checkpoint_id, "format": "pt"})
        files[ix.RNG_FILE] = {
            "bytes": written.bytes,
            "tensors": {k: ["U8", list(t.shape)] for k, t in rng.items()},
            "checksums": written.checksums,
        }
        index = self.build_index(files)
        ix.check_index(index, f"{self.final}/{ix.INDEX_NAME} (while saving)")
        atomic.write_json(self.tmp / ix.INDEX_NAME, index)
        atomic.publish_dir(self.tmp, self.final)
        atomic.write_text_atomic(self.root / "newest", self.tag)
        if self.num_kept is not None:
            prune(self.root, keep=self.num_kept, protect=self.final)
        return str(self.final)

    def freeze(self) -> dict[str, Any]:
        """Take the index's entries that come from the live model and optimizer (shapes, param groups with
        their `lr`, loss scaler, backward count) now: an async save commits after training moved on."""
        model, plan = self.model, self.model.topology.plan
        params: dict[str, Any] = {}
        every = slots(model)
        for slot in every:  # rank 0's: every TP rank has the same FQNs, and the cut is the same
            if slot.frozen:
                continue
            entry = {"shape": list(slot.cut.full_shape), "dtype": dtype_name(slot.view.dtype), "pieces": []}
            tp = ix.cut_entry(slot.cut)
            params[slot.fqn] = entry if tp is None else {**entry, "tp": tp}
        buffers = {
            n: {"file": ix.shard_file(0), "dtype": dtype_name(b.dtype), "shape": list(b.shape)}
            for n, b in persistent_buffers(model).items()
        }
        self.frozen = {
            "params": params,
            "frozen": fingerprint.entries(every),
            "buffers": buffers,
            "num_backward": model.window.num_backward,
            "topology": {"world": plan.world, "tp": plan.tp, "sdp": plan.sdp, "ranks_per_node": plan.ranks_per_node},
            "optimizer": self._optimizer_groups(),
            "loss_scaler": self.optimizer.loss_scaler_state() if self.optimizer is not None else None,
            "world": plan.world,
        }
        return self.frozen

    def build_index(self, files: dict[str, Any]) -> dict[str, Any]:
        frozen = copy.deepcopy(self.frozen if self.frozen is not None else self.freeze())
        params = frozen["params"]
        for rep in self.reports:
            for fqn, (start, length, tp_rank) in rep["pieces"].items():
                params[fqn]["pieces"].append([rep["file"]["name"], start, length, tp_rank])
        for entry in params.values():
            entry["pieces"].sort(key=lambda p: (p[3], p[1]))
        base = frozen["frozen"]
        sums = fingerprint.combine(
            (rep.get("frozen", {}) for rep in self.reports), {f: ix.cut_of(e).size for f, e in base.items()}
        )
        for fqn, entry in base.items():
            entry["checksums"] = sums[fqn]
        optimizer = frozen["optimizer"]
        if optimizer is not None:
            for rep in self.reports:  # first writer in rank order wins; writers of one parameter agree
                for fqn, meta in rep["state"].items():
                    optimizer["state"].setdefault(fqn, meta)
        index = {
            "format": ix.FORMAT,
            # version 3 only where it matters: a reader of version 2 would load nothing into the frozen base
            "version": ix.VERSION if base else ix.VERSION_WITHOUT_FROZEN,
            "tag": self.tag,
            "checkpoint_id": self.checkpoint_id,
            "saved_at_ns": time.time_ns(),
            "step": self._step(),
            "num_backward": frozen["num_backward"],
            "topology": frozen["topology"],
            "files": files,
            "params": params,
            "buffers": frozen["buffers"],
            "optimizer": optimizer,
            "loss_scaler": frozen["loss_scaler"],
            "rng": {"file": ix.RNG_FILE, "world": frozen["world"]},
            "user_content": self.user_content,
        }
        if base:
            index["frozen"] = base
        return index

    def _optimizer_groups(self) -> dict[str, Any] | None:
        if self.optimizer is None:
            return None
        fqn_of = fqn_of_piece(self.model, self.optimizer)
        groups = [
            {
                "params": [fqn_of[id(p)] for p in g["params"]],
                "options": ix.encode({k: v for k, v in g.items() if k != "params"}, where="optimizer param group"),
            }
            for g in self.optimizer.param_groups
        ]
        return {"class": type(self.optimizer.optimizer).__name__, "param_groups": groups, "state": {}}

    def _step(self) -> int | None:
        """The optimizer's step count where its state keeps one (`step`, as Adam does); informative."""
        metas = [m.get("owned", m) for rep in self.reports for m in rep["state"].values()]  # owned_state.py's
        steps = [ix.decode(m["scalars"].get("step")) for m in metas]
        numbers = [float(s) for s in steps if isinstance(s, (int, float, torch.Tensor)) and not isinstance(s, bool)]
        return int(max(numbers)) if numbers else None


def prune(root: Path, *, keep: int, protect: Path) -> None:
    """Delete all but the `keep` newest partial checkpoints in `root` (by their save time)."""
    found = []
    for d in root.iterdir():
        if d.is_dir() and d.name.endswith(ix.PARTIAL_SUFFIX) and not d.name.startswith("."):
            try:
                found.append((int(ix.read_index(d)["saved_at_ns"]), d))
            except CheckpointError:
                continue  # not ours, or damaged: never delete what we cannot identify
    found.sort(reverse=True)
    for _, d in found[keep:]:
        if d != protect:
            atomic.remove_dir(d)
