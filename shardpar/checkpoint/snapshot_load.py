"""In-memory snapshots, the load side: the newest complete state among snapshots and the disk checkpoint.

[Note: choosing a snapshot]
Every rank lists the snapshots it can read without their data (trailers only): its own two files and
those of its replica peers that lie in the same directory (the same node). One all-gather later every
rank knows, for each step, which ranks hold it. A step is complete when every rank either holds it
or has a replica peer that does ([Note: in-memory snapshots]); with shard_optimizer_state there are
no peers, so every rank must hold it. Rank 0 adds the disk checkpoint's `newest` (its optimizer step
and save time). The newest complete snapshot wins over the disk when its optimizer step (Adam's
`step`, what the index records) is at least the disk's, or, where the optimizer keeps no step, when
it was taken later; a tie goes to memory (the same state, read from RAM).

Then each rank reads its bytes -- its own file; else its peer's file where it can see it; else the
peer sends the file (a world broadcast, the rare path of a replaced node) -- and checks the checksum,
the layout and the optimizer; the ranks agree, and only then is anything written into the model.
A snapshot that fails there is reported and the disk checkpoint is loaded instead (nothing was
changed yet). A rank that loads a peer's bytes keeps its own RNG state (the peer's is the peer's).
"""

from __future__ import annotations

import base64
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardpar.checkpoint import atomic
from shardpar.checkpoint import index as ix
from shardpar.checkpoint import snapshot as snap
from shardpar.checkpoint.atomic import Coordinator
from shardpar.checkpoint.owned_state import owned_entry
from shardpar.checkpoint.pieces import buffer_shape_problems, fqn_of_piece, persistent_buffers, piece_of, slots
from shardpar.checkpoint.safetensors_io import CheckpointError, dtype_of
from shardpar.collectives.native import broadcast_object
from shardpar.optim.loss_scaling import ScalerResume
from shardpar.optim.optimizer import DistributedOptimizer
from shardpar.runtime.model import DistributedModel
from shardpar.runtime.sharded_tensor import ShardedTensor

Payload = bytes | bytearray | mmap.mmap  # a snapshot's tensor bytes: a mapping of its file, or what a peer sent

# What the last resume_from_checkpoint loaded: {"source": "memory" | "disk", "step": ..., "where": ...}
# (smp.last_resume(); the recipes print it).
last: dict[str, Any] = {}


@dataclass
class Choice:
    step: int
    sources: list[tuple[str, int]]  # per rank: ("own" | "read" | "send", the rank whose file it is)
    description: str


def _peers_of(model: DistributedModel, rank: int) -> list[int]:
    if model.sharded_state.replica_sharded:
        return []
    return [r for r in model.topology.plan.groups_of(rank)["replication"] if r != rank]


def _listing(directory: Path, model: DistributedModel) -> dict[str, Any]:
    """This rank's readable snapshots of the current layout: its own and its peers' (steps only)."""
    rank, layout = model.topology.rank, snap.layout_of(model)

    def steps_of(r: int) -> dict[int, list[Any]]:
        out: dict[int, list[Any]] = {}
        for slot in (0, 1):
            t = snap.read_trailer(snap.file_of(directory, r, slot))
            if t is not None and t["layout"] == layout and int(t["rank"]) == r:
                out[int(t["step"])] = [t.get("optimizer_step"), int(t["saved_at_ns"])]
        return out

    return {"own": steps_of(rank), "visible": {p: sorted(steps_of(p)) for p in _peers_of(model, rank)}}


def _disk_newest(root: Path) -> dict[str, Any] | None:
    """Rank 0: the disk checkpoint `newest` names (its optimizer step and save time), or None."""
    if not (root / "newest").is_file():
        return None
    try:
        name = atomic.read_pointer(root, "newest")
        index = ix.read_index(root / f"{name}{ix.PARTIAL_SUFFIX}")
    except (CheckpointError, ValueError):
        return None  # the disk load reports it, if it comes to that
    return {"tag": name, "step": index.get("step"), "saved_at_ns": int(index["saved_at_ns"])}


def choose(model: DistributedModel, reports: list[dict[str, Any]], disk: dict[str, Any] | None) -> Choice | None:
    """The newest complete snapshot if it is at least as new as the disk checkpoint (the same on every rank)."""
    world = len(reports)
    steps = sorted({s for rep in reports for s in rep["own"]}, reverse=True)
    for step in steps:
        sources: list[tuple[str, int]] = []
        for r in range(world):
            if step in reports[r]["own"]:
                sources.append(("own", r))
                continue
            holders = [p for p in _peers_of(model, r) if step in reports[p]["own"]]
            if not holders:
                break
            seen = [p for p in holders if step in reports[r]["visible"].get(p, [])]
            sources.append(("read", seen[0]) if seen else ("send", holders[0]))
        if len(sources) < world:
            continue
        held = [reports[r]["own"][step] for r in range(world) if step in reports[r]["own"]]
        opt_steps = [h[0] for h in held if h[0] is not None]
        opt_step, taken_at = (max(opt_steps) if opt_steps else None), min(h[1] for h in held)
        if disk is not None:
            if opt_step is not None and disk["step"] is not None:
                newer = opt_step >= int(disk["step"])
            else:
                newer = taken_at >= disk["saved_at_ns"]
            if not newer:
                return None  # the disk checkpoint is newer than every complete snapshot
        borrowed = sum(kind != "own" for kind, _ in sources)
        sent = sum(kind == "send" for kind, _ in sources)
        note = f", {borrowed} rank(s) from a replica peer's snapshot ({sent} sent)" if borrowed else ""
        return Choice(step, sources, f"memory snapshot of step {step}{note}")
    return None


def _fetch(directory: Path, choice: Choice, coord: Coordinator) -> tuple[dict[str, Any], Payload | None, str]:
    """This rank's trailer and verified bytes (None and an error text when they fail)."""
    rank = coord.rank
    kind, holder = choice.sources[rank]
    got: tuple[dict[str, Any], Payload | None, str] | None = None
    for r, (k, p) in enumerate(choice.sources):  # the rare path: every rank joins each peer's broadcast
        if k != "send":
            continue
        payload: Any = None
        if rank == p:
            t, d, e = _read(directory, p, choice.step)
            payload = (t, bytearray(d) if d is not None else None, e)  # a mapping does not pickle
        payload = broadcast_object(payload, p, coord.world)
        if r == rank:
            got = payload
    if got is None:
        got = _read(directory, holder, choice.step)
    if kind != "own" and got[1] is not None:
        got[0]["rng"] = None  # the peer's RNG is the peer's
    return got


def _read(directory: Path, rank: int, step: int) -> tuple[dict[str, Any], Payload | None, str]:
    for slot in (0, 1):
        path = snap.file_of(directory, rank, slot)
        t = snap.read_trailer(path)
        if t is not None and int(t["step"]) == step:
            try:
                return t, snap.read_payload(path, t), ""
            except (OSError, ValueError) as e:
                return t, None, str(e)
    return {}, None, f"snapshot of rank {rank} at step {step} vanished from {directory}"


def _problems(trailer: dict[str, Any], model: DistributedModel, optimizer: DistributedOptimizer | None) -> list[str]:
    """Why these bytes cannot be copied into this rank's model and optimizer as they are."""
    mine = {s.fqn: [s.start, s.length] for s in slots(model) if s.length}
    problems = [
        f"{f}: pieces differ"
        for f in sorted(set(mine) | set(trailer["pieces"]))
        if mine.get(f) != trailer["pieces"].get(f)
    ]
    shapes = {k[len("buffer/") :]: v[1] for k, v in trailer["tensors"].items() if k.startswith("buffer/")}
    problems += buffer_shape_problems(persistent_buffers(model), shapes)
    problems += [f"buffer {b}: not in the snapshot" for b in persistent_buffers(model) if b not in shapes]
    saved = trailer.get("optimizer")
    if optimizer is not None:
        if saved is None or saved["class"] != type(optimizer.optimizer).__name__:
            problems.append(
                f"optimizer: snapshot of {saved and saved['class']}, loading into {type(optimizer.optimizer).__name__}"
            )
        else:
            fqn_of = fqn_of_piece(model, optimizer)
            now = [[fqn_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]
            if now != [g["params"] for g in saved["param_groups"]]:
                problems.append("optimizer: param groups differ")
    return problems


def try_resume(
    root: Path, directory: Path, model: DistributedModel, optimizer: DistributedOptimizer | None, coord: Coordinator
) -> tuple[bool, Any]:
    """Collective: load the newest complete snapshot when it is at least as new as the disk checkpoint;
    (True, its user_content), or (False, None) for the caller to load the disk checkpoint."""
    reports = coord.gather("resume_from_checkpoint: listing snapshots", lambda: _listing(directory, model))
    disk = coord.on_root("resume_from_checkpoint: reading newest", lambda: _disk_newest(root))
    choice = choose(model, reports, disk)
    if choice is None:
        return False, None
    trailer, data, error = _fetch(directory, choice, coord)
    plan: list[ScalerResume | None] = [None]

    def check() -> None:
        if data is None:
            raise ValueError(error)
        problems = _problems(trailer, model, optimizer)
        if problems:
            raise ValueError(f"{directory}: the snapshot does not fit this model: " + "; ".join(problems[:5]))
        if optimizer is not None and trailer.get("loss_scaler") is not None:
            plan[0] = optimizer.plan_loss_scaler_load(trailer["loss_scaler"])

    try:
        coord.gather("resume_from_checkpoint: checking the snapshot", check)
    except Exception as e:  # nothing was loaded: the disk checkpoint, if there is one, is the way back
        if disk is None:
            raise CheckpointError(f"{choice.description} is unusable and no disk checkpoint exists: {e}") from e
        if coord.is_root:
            import warnings

            warnings.warn(f"{choice.description} is unusable, loading the disk checkpoint instead: {e}", stacklevel=3)
        return False, None
    if data is None:
        raise AssertionError("checked snapshot bytes missing")
    _apply(trailer, data, model, optimizer, plan[0])
    last.clear()
    last.update(source="memory", step=choice.step, where=str(directory), description=choice.description)
    return True, ix.decode(trailer["user_content"])


def _tensor(trailer: dict[str, Any], data: Payload, key: str) -> torch.Tensor:
    dtype, shape, offset, nbytes = trailer["tensors"][key]
    flat = (
        torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=offset)
        if nbytes
        else torch.empty(0, dtype=torch.uint8)
    )
    return flat.view(dtype_of(dtype)).view(shape)


def _apply(
    trailer: dict[str, Any],
    data: Payload,
    model: DistributedModel,
    optimizer: DistributedOptimizer | None,
    plan: ScalerResume | None,
) -> None:
    with torch.no_grad():
        for s in slots(model):
            if s.length:
                s.value.copy_(_tensor(trailer, data, ix.param_key(s.fqn)).view(s.shape))
        for name, buf in persistent_buffers(model).items():
            buf.copy_(_tensor(trailer, data, ix.buffer_key(name)))
        model.sharded_state.refresh_compute()
        if optimizer is not None:
            saved = trailer["optimizer"]
            for group, entry in zip(optimizer.param_groups, saved["param_groups"], strict=True):
                group.update({k: v for k, v in ix.decode(entry["options"]).items() if k != "params"})
            state = optimizer.optimizer.state
            state.clear()
            for s in slots(model):
                meta, piece = trailer["state"].get(s.fqn), piece_of(optimizer, s.param)
                if meta is None or piece is None:
                    continue
                entry = {k: ix.decode(v, device=piece.device) for k, v in meta["scalars"].items()}
                for k in meta["tensors"]:
                    value = _tensor(trailer, data, ix.state_key(k, s.fqn)).view(s.shape).to(piece.device, copy=True)
                    entry[k] = ShardedTensor(value, piece.shard_layout) if isinstance(piece, ShardedTensor) else value
                state[piece] = entry
            for fqn, leaf, mine in optimizer.owned_leaves():  # the same owners as when it was taken (same layout)
                saved_owned = trailer.get("owned", {}).get(fqn)
                if mine and saved_owned is not None:  # copies: the payload is a mapping of the file
                    read = lambda key: _tensor(trailer, data, key).clone()  # noqa: E731
                    state[leaf] = owned_entry(saved_owned, read, fqn, leaf.device, "snapshot")
            if plan is not None:
                optimizer.load_loss_scaler_state(trailer["loss_scaler"], plan)
    rng = trailer.get("rng")
    if rng:
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng["torch"])), dtype=torch.uint8))
        if torch.cuda.is_available() and "cuda" in rng:
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng["cuda"])), dtype=torch.uint8))
