"""In-memory snapshots: every N steps each rank copies its state into host shared memory of its node.

[Note: in-memory snapshots]
A disk checkpoint is written once per shard (replica 0) and committed by rank 0; a snapshot is the
opposite trade: every rank writes, with no collective, everything it holds itself -- its fp32 shards
of the sharded parameters, the persistent parameters, its optimizer state (per-element tensors and
scalars, param groups with their lr), the loss scaler, the buffers, its RNG state, and the caller's
`user_content` (the step and data position) -- into one file of node-local host shared memory:

    <checkpoint_snapshot_dir>/shardpar-snap-<job>/rank<R>.<0|1>.snap     (default dir: /dev/shm)

`<job>` is `checkpoint_snapshot_job`, else a hash of the checkpoint path the snapshot accompanies, so
the same job started again (torchrun --max-restarts, a scheduler's requeue) finds it. A file in
/dev/shm outlives the process (kill -9, a crash), not the node; it is RAM, so it is bounded: each rank
keeps two files, written alternately (double buffering): the older one is deleted before the next
is written, so at any time at least one complete snapshot exists and at most two do. Two, not one:
ranks do not agree on a snapshot (no collective), so a rank killed while writing step 20 leaves
step 10 behind while the others finished step 20; the step all ranks still have is 10.

A write is atomic: a temporary `.rank<R>.tmp-<pid>` file renamed into place. The file is the raw
tensor bytes followed by a JSON trailer (layout, tensor table, CRC-32 of the bytes, step) and a
16-byte footer (trailer length, magic): one pass writes and hashes, and a reader finds the trailer
without reading the data. A torn or damaged file fails its checksum and is ignored.

Replicas: where the MiCS layout keeps the same shard on other ranks (the replication group of each
rank: same tp rank and sdp rank, other replicas), their snapshots hold the same model and optimizer
bytes; the trailer names those peers, and a rank whose own snapshot is gone (its node replaced)
takes its peer's (snapshot_load.py). With `shard_optimizer_state` each replica owns a different
piece of the fp32 main values and optimizer state, so no rank's snapshot has a copy elsewhere:
`peers` is empty, and a missing file means the disk checkpoint. Loading is snapshot_load.py.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import mmap
import os
import struct
import time
import zlib
from pathlib import Path
from typing import Any

import torch

from shardpar.checkpoint import index as ix
from shardpar.checkpoint.owned_state import owned_entries
from shardpar.checkpoint.pieces import fqn_of_piece, persistent_buffers, piece_of, slots, split_state
from shardpar.checkpoint.safetensors_io import dtype_name
from shardpar.optim.optimizer import DistributedOptimizer
from shardpar.runtime.model import DistributedModel

FORMAT = "shardpar.snapshot/1"
MAGIC = b"SPSNAP01"
_FOOTER = struct.Struct("<Q8s")  # trailer length, magic
_CHUNK = 64 << 20  # bytes hashed and written per call (zlib and write release the GIL on each)


# The snapshot directories this process wrote or resumed from: a normal finish (smp.shutdown) removes this
# rank's files there. A killed process never gets there, which is the point.
written: set[Path] = set()


def discard_written(rank: int) -> None:
    """Delete this rank's snapshots in every directory of `written` (local)."""
    for directory in sorted(written):
        remove_rank(directory, rank)
    written.clear()


def job_key(path: str | os.PathLike[str], job: str | None) -> str:
    """The name snapshots of the checkpoint at `path` go under: `job` when given, else a hash of the path."""
    if job:
        if "/" in job or job.startswith("."):
            raise ValueError(f"checkpoint_snapshot_job={job!r} names a directory: use letters, digits, '-' or '_'")
        return job
    return hashlib.sha1(os.path.realpath(os.fspath(path)).encode()).hexdigest()[:16]


def snapshot_dir(base: str | os.PathLike[str], key: str) -> Path:
    return Path(base) / f"shardpar-snap-{key}"


def file_of(directory: Path, rank: int, slot: int) -> Path:
    return directory / f"rank{rank:05d}.{slot}.snap"


def replica_peers(model: DistributedModel) -> list[int]:
    """The ranks whose snapshots hold this rank's model and optimizer bytes ([Note: in-memory snapshots])."""
    if model.sharded_state.replica_sharded:
        return []  # shard_optimizer_state: each replica's main values and optimizer state are its own
    rank = model.topology.rank
    return [r for r in model.topology.plan.groups_of(rank)["replication"] if r != rank]


def layout_of(model: DistributedModel) -> dict[str, Any]:
    """What a snapshot must match to be loaded as it is: the same topology (no resharding from memory)."""
    plan = model.topology.plan
    return {"world": plan.world, "tp": plan.tp, "sdp": plan.sdp, "replica_sharded": model.sharded_state.replica_sharded}


def collect(
    model: DistributedModel, optimizer: DistributedOptimizer | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's tensors (views of the live ones) and the JSON that goes with them."""
    tensors: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[int]] = {}
    state_meta: dict[str, Any] = {}
    steps: list[float] = []
    owned = {id(leaf) for _, leaf, _ in optimizer.owned_leaves()} if optimizer is not None else set()
    for s in slots(model):
        if not s.length:
            continue
        pieces[s.fqn] = [s.start, s.length]
        tensors[ix.param_key(s.fqn)] = s.value.reshape(-1)
        piece = piece_of(optimizer, s.param) if optimizer is not None else None
        if piece is not None and id(piece) in owned:
            piece = None  # stepped whole on its owner: its state is in "owned" below
        state = optimizer.optimizer.state.get(piece) if optimizer is not None and piece is not None else None
        if state:
            per_element, scalars = split_state(s, state)
            state_meta[s.fqn] = {
                "tensors": {k: dtype_name(v.dtype) for k, v in per_element.items()},
                "scalars": scalars,
            }
            for k, v in per_element.items():
                tensors[ix.state_key(k, s.fqn)] = v.reshape(-1)
            step = state.get("step")
            if isinstance(step, (int, float, torch.Tensor)) and not isinstance(step, bool):
                steps.append(float(step))
    # Owner-held state ([Note: owner compute]): each owner writes the whole state of what it owns, as partial
    # checkpoints do (owned_state.py). A snapshot loads on the same layout only, so the same ranks own the
    # same parameters then; a replica peer owns the same ones and holds the same state.
    owned_meta = owned_entries(optimizer, tensors) if optimizer is not None else {}
    steps += [_number(ix.decode(m["scalars"]["step"])) for m in owned_meta.values() if "step" in m["scalars"]]
    for name, buf in persistent_buffers(model).items():
        tensors[ix.buffer_key(name)] = buf
    meta: dict[str, Any] = {
        "pieces": pieces,
        "state": state_meta,
        "owned": owned_meta,
        # the optimizer's own step count (Adam's `step`): what a disk checkpoint's index records as "step",
        # so the two kinds are compared on the same scale (snapshot_load.newest)
        "optimizer_step": int(max(steps)) if steps else None,
        "optimizer": _optimizer_meta(model, optimizer),
        "loss_scaler": optimizer.loss_scaler_state() if optimizer is not None else None,
        "rng": {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()},
    }
    if torch.cuda.is_available():
        meta["rng"]["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return tensors, meta


def _number(step: Any) -> float:
    return float(step) if isinstance(step, (int, float, torch.Tensor)) and not isinstance(step, bool) else 0.0


def _optimizer_meta(model: DistributedModel, optimizer: DistributedOptimizer | None) -> dict[str, Any] | None:
    if optimizer is None:
        return None
    fqn_of = fqn_of_piece(model, optimizer)
    groups = [
        {
            "params": [fqn_of[id(p)] for p in g["params"]],
            "options": ix.encode({k: v for k, v in g.items() if k != "params"}, where="optimizer param group"),
        }
        for g in optimizer.param_groups
    ]
    return {"class": type(optimizer.optimizer).__name__, "param_groups": groups}


def _bytes_of(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data  # uint8, one dimension: bytes as they are


def write(
    directory: Path,
    model: DistributedModel,
    optimizer: DistributedOptimizer | None,
    *,
    step: int,
    user_content: Any,
) -> Path:
    """Write this rank's snapshot of `step` (local, no collective); the file written."""
    rank = model.topology.rank
    directory.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):  # a peer's remove_rank took the directory (see _create)
        for stale in directory.glob(f".rank{rank:05d}.tmp-*"):  # a write a killed process left
            stale.unlink(missing_ok=True)
    content = ix.encode(user_content, where="snapshot user_content")  # before anything is deleted
    tensors, meta = collect(model, optimizer)
    target = file_of(directory, rank, _older_slot(directory, rank))
    target.unlink(missing_ok=True)  # the newer file stays: the RAM bound is two snapshots, not three
    tmp = directory / f".rank{rank:05d}.tmp-{os.getpid()}"
    table: dict[str, list[Any]] = {}
    crc, offset = 0, 0
    try:
        with _create(tmp) as f:
            for key, t in tensors.items():
                data = _bytes_of(t)
                for lo in range(0, len(data), _CHUNK):
                    chunk = data[lo : lo + _CHUNK]
                    crc = zlib.crc32(chunk, crc)
                    f.write(chunk)
                table[key] = [dtype_name(t.dtype), list(t.shape), offset, len(data)]
                offset += len(data)
            trailer = {
                "format": FORMAT,
                "rank": rank,
                "step": int(step),
                "saved_at_ns": time.time_ns(),
                "layout": layout_of(model),
                "peers": replica_peers(model),
                "tensors": table,
                "bytes": offset,
                "checksum": f"crc32:{crc:08x}",
                "user_content": content,
                **meta,
            }
            blob = json.dumps(trailer, allow_nan=False).encode()
            f.write(blob)
            f.write(_FOOTER.pack(len(blob), MAGIC))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _create(path: Path, attempts: int = 3) -> io.BufferedWriter:
    """Open `path` for writing, making its directory again if it went. A peer that finishes (smp.shutdown)
    removes the directory once no rank's file is in it: before this rank's first snapshot file exists
    the directory may be empty, and go between write's mkdir and this open. Once the file is open
    the directory is not empty, so no peer's rmdir succeeds. Removed `attempts` times in a row is no
    race: that error goes through."""
    for _ in range(attempts - 1):
        try:
            return open(path, "wb")
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "wb")


def _older_slot(directory: Path, rank: int) -> int:
    """The slot to overwrite: an empty or unreadable one, else the one holding the older snapshot."""
    seen = []
    for slot in (0, 1):
        trailer = read_trailer(file_of(directory, rank, slot))
        if trailer is None:
            return slot
        seen.append((int(trailer["saved_at_ns"]), slot))
    return min(seen)[1]


def read_trailer(path: Path) -> dict[str, Any] | None:
    """The JSON trailer of a snapshot file without reading its data; None when absent, torn or not ours."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size < _FOOTER.size:
                return None
            f.seek(size - _FOOTER.size)
            length, magic = _FOOTER.unpack(f.read(_FOOTER.size))
            if magic != MAGIC or length > size - _FOOTER.size:
                return None
            f.seek(size - _FOOTER.size - length)
            trailer = json.loads(f.read(length))
    except (OSError, ValueError):
        return None
    if not isinstance(trailer, dict) or trailer.get("format") != FORMAT:
        return None
    if int(trailer["bytes"]) + length + _FOOTER.size != size:
        return None
    return trailer


def read_payload(path: Path, trailer: dict[str, Any]) -> mmap.mmap:
    """The tensor bytes of a snapshot, checked against its recorded CRC-32 (ValueError on a mismatch).

    A private mapping of the file, not a copy: /dev/shm pages are RAM already, so mapping them costs no
    read and no fresh (zero-filled) allocation -- the one copy a load makes is into the model. Private
    (copy-on-write) only because torch.frombuffer wants a writable buffer; nothing writes to it."""
    size = int(trailer["bytes"])
    if size == 0:
        return mmap.mmap(-1, 1)
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    verify(data, trailer, str(path))
    return data


def verify(data: bytes | bytearray | mmap.mmap, trailer: dict[str, Any], where: str) -> None:
    crc, view = 0, memoryview(data)
    for lo in range(0, len(view), _CHUNK):
        crc = zlib.crc32(view[lo : lo + _CHUNK], crc)
    if f"crc32:{crc:08x}" != trailer["checksum"]:
        raise ValueError(f"{where}: checksum crc32:{crc:08x} differs from the recorded {trailer['checksum']}")


def remove_rank(directory: Path, rank: int) -> None:
    """Delete this rank's snapshots (a normal finish); the directory too once no rank's file is left."""
    for slot in (0, 1):
        file_of(directory, rank, slot).unlink(missing_ok=True)
    # Another rank's remove_rank may rmdir the directory as soon as this rank's files above are gone.
    with contextlib.suppress(FileNotFoundError):
        for stale in directory.glob(f".rank{rank:05d}.tmp-*"):
            stale.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # other ranks' files are still there (they remove theirs), or it is gone
        directory.rmdir()
