"""The partial checkpoint's JSON index: value encoding, piece arithmetic and structural checks (pure).

    <tag>_partial/
        index.json               this file's schema (below); written last, inside the temporary dir
        shard-00000.safetensors  rank 0 (replica 0): its pieces of every sharded parameter, plus the
                                 persistent parameters and buffers (written once)
        shard-00001.safetensors  rank 1, if it is in replica 0; other replicas write nothing (with
                                 tp > 1, rank r < tp also writes TP rank r's persistent TP-split ones)
        rng.safetensors          every rank's RNG state (gathered to rank 0)

A sharded parameter is stored as the pieces its writers own: piece (file, start, length, tp_rank)
holds flat elements [start, start + length) of TP rank tp_rank's flattened local parameter under
`param/<fqn>`, and the optimizer state of those elements under `optim/<state name>/<fqn>`. `shape`
is the full (Hugging Face) shape; `tp` (absent when the parameter is not TP-split) says how each TP
rank's local tensor maps into it (placement.Cut, [Note: full-parameter coordinates]). TP-replicated
parameters are written by TP rank 0 only. Any reader topology (world, sdp and tp) rebuilds its own
slices from the pieces by offset arithmetic (`overlaps`, placement.plan_fetch), reading only the
ranges it needs.

    index.json = {format, version, tag, checkpoint_id, saved_at_ns, step, num_backward,
                  topology: {world, tp, sdp, ranks_per_node},
                  files:   {name: {bytes, tensors: {key: [dtype, shape]},
                                  checksums: {key: "crc32:<8 hex>"} (absent before checksums were added)}},
                  params:  {fqn: {shape, dtype, tp?: {dim, size, num_parts},
                                  pieces: [[file, start, length, tp_rank], ...]}},   parameters that train
                  frozen?: {fqn: {shape, dtype, tp?, checksums: ["crc32:<8 hex>" per TP rank]}},
                           parameters that do not: a fingerprint, no values (fingerprint.py; version 3)
                  buffers: {name: {file, dtype, shape}},
                  optimizer: null | {class, param_groups: [{params: [fqn...], options}],
                                     state: {fqn: {tensors: {name: dtype}, scalars: {name: value}}}},
                  loss_scaler: null | {kind: static | dynamic, loss_scale, <dynamic: its counters>,
                                       precision: fp32 | bf16 | fp16 (absent before it was added)},
                  rng: {file, world}, user_content}
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardpar.checkpoint import checksum, objects
from shardpar.checkpoint.placement import Cut
from shardpar.checkpoint.safetensors_io import CheckpointError, dtype_name, dtype_of, tensor_nbytes

FORMAT = "shardpar.partial"
VERSION = 3  # 3: a "frozen" section (fingerprint.py); 2: pieces carry a TP rank, params a `tp` cut
VERSION_WITHOUT_FROZEN = 2  # what a checkpoint of a model without frozen parameters is written as
READS_VERSIONS = (1, 2, 3)
INDEX_NAME = "index.json"
RNG_FILE = "rng.safetensors"
PARTIAL_SUFFIX = "_partial"


def shard_file(rank: int) -> str:
    return f"shard-{rank:05d}.safetensors"


def param_key(fqn: str) -> str:
    return f"param/{fqn}"


def state_key(name: str, fqn: str) -> str:
    return f"optim/{name}/{fqn}"


def buffer_key(name: str) -> str:
    return f"buffer/{name}"


def rng_key(kind: str, rank: int) -> str:
    return f"rng/{kind}/{rank}"


# ---- JSON values (no pickle: a checkpoint can never execute code) -------------------------------


def encode(value: Any, *, where: str) -> Any:
    """A JSON-able form of `value` that `decode` turns back into the same types (objects.py lists them):
    user_content keeps tuples, int-keyed dicts, OrderedDicts, Counters, numpy values, HF configs and
    (small) tensors, stored inline with their shape and dtype."""
    return objects.encode(value, where, _inline_tensor)


def _inline_tensor(value: torch.Tensor, where: str) -> dict[str, Any]:
    t = value.detach().cpu()
    # tolist() drops the dims after a zero-size one ([[], []] for (2, 0, 3)), so the shape goes beside it
    return {
        "__tensor__": t.tolist(),
        "shape": list(t.shape),
        "dtype": dtype_name(t.dtype),
        "on_device": value.device.type != "cpu",
    }


def decode(obj: Any, *, device: torch.device | None = None) -> Any:
    def tensor(ref: dict[str, Any]) -> torch.Tensor:
        t = torch.tensor(ref["__tensor__"], dtype=dtype_of(ref["dtype"]))
        if "shape" in ref:  # absent in checkpoints written before it was added
            t = t.reshape(ref["shape"])
        return t.to(device) if ref.get("on_device") and device is not None else t

    return objects.decode(obj, tensor)


# ---- pieces ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    file: str
    start: int
    length: int
    tp_rank: int = 0


def pieces_of(index: dict[str, Any], fqn: str) -> list[Piece]:
    return [
        Piece(str(p[0]), int(p[1]), int(p[2]), int(p[3]) if len(p) > 3 else 0) for p in index["params"][fqn]["pieces"]
    ]


def cut_of(entry: dict[str, Any]) -> Cut:
    """How the saved parameter was cut over TP ranks (Cut of its full shape; size 1: not split)."""
    shape = tuple(int(d) for d in entry["shape"])
    tp = entry.get("tp")
    if not tp:
        return Cut(shape)
    return Cut(shape, int(tp["dim"]), int(tp["size"]), int(tp["num_parts"]))


def cut_entry(cut: Cut) -> dict[str, int] | None:
    return None if cut.size == 1 else {"dim": cut.dim, "size": cut.size, "num_parts": cut.num_parts}


def overlaps(pieces: list[Piece], tp_rank: int, start: int, length: int) -> Iterator[tuple[Piece, int, int]]:
    """(piece, lo, hi): the part [lo, hi) of TP rank `tp_rank`'s wanted local range [start, start + length)
    each piece holds."""
    end = start + length
    for p in pieces:
        lo, hi = max(start, p.start), min(end, p.start + p.length)
        if p.tp_rank == tp_rank and lo < hi:
            yield p, lo, hi


def numel_of(shape: list[int] | tuple[int, ...]) -> int:
    return math.prod(int(d) for d in shape)


# ---- reading and checking ---------------------------------------------------------------------------


def require_directory(directory: Path) -> None:
    """CheckpointError unless `directory` is one; a file there is named as a file, with where it loads."""
    if directory.is_file():
        raise CheckpointError(
            f"{directory} is a file, not a checkpoint directory (smp.save_checkpoint writes directories); a full "
            "model saved with torch.save (SMP v1's fullmodel.pt) loads with smp.resume_from_checkpoint(path, "
            "partial=False)"
        )
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory is missing")


def read_index(directory: Path) -> dict[str, Any]:
    path = directory / INDEX_NAME
    label = f"{directory}/{INDEX_NAME}"
    require_directory(directory)
    if not path.is_file():
        raise CheckpointError(f"{label}: file is missing (the save never completed?)")
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{label}: not valid JSON ({e}); the file is truncated or corrupt") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{label}: not a shardpar partial checkpoint index (format {FORMAT!r} expected)")
    if index.get("version") not in READS_VERSIONS:
        raise CheckpointError(
            f"{label}: index version {index.get('version')!r}; this shardpar reads versions {list(READS_VERSIONS)}"
        )
    check_index(index, label)
    return index


def _expect(cond: bool, label: str, problem: str) -> None:
    if not cond:
        raise CheckpointError(f"{label}: {problem}")


def check_index(index: dict[str, Any], label: str) -> None:
    """Every piece covers its parameter exactly once and names a tensor the file table lists."""
    try:
        _check_index(index, label)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{label}: malformed index ({type(e).__name__}: {e})") from None


def _check_index(index: dict[str, Any], label: str) -> None:
    files = index["files"]
    state = (index.get("optimizer") or {}).get("state", {})
    for fqn, entry in index["params"].items():
        try:
            cut = cut_of(entry)
        except AssertionError as e:
            raise CheckpointError(f"{label}: parameter {fqn!r}: impossible tp cut ({e})") from None
        pieces = pieces_of(index, fqn)
        odd = sorted({p.tp_rank for p in pieces} - set(range(cut.size)))
        _expect(not odd, label, f"parameter {fqn!r}: pieces of TP rank {odd} in a cut over {cut.size} TP ranks")
        wanted = {param_key(fqn): entry["dtype"]}
        wanted.update({state_key(k, fqn): d for k, d in state.get(fqn, {}).get("tensors", {}).items()})
        for tp_rank in range(cut.size):
            mine = sorted((p for p in pieces if p.tp_rank == tp_rank), key=lambda p: p.start)
            where = f"parameter {fqn!r}" + (f" (TP rank {tp_rank} of {cut.size})" if cut.size > 1 else "")
            _check_cover(mine, cut.local_numel, wanted, files, label, where)
    for fqn, entry in index.get("frozen", {}).items():
        n = cut_of(entry).size
        sums = entry.get("checksums")
        _expect(isinstance(sums, list) and len(sums) == n, label, f"frozen {fqn!r}: {n} checksums expected")
        for value in sums:
            checksum.parse(value, where=f"{label}: frozen {fqn!r}")
    for name, entry in index["buffers"].items():
        got = files.get(entry["file"], {}).get("tensors", {}).get(buffer_key(name))
        _expect(got is not None, label, f"buffer {name!r}: {entry['file']!r} does not list it")
    for name, entry in files.items():  # [Note: checkpoint checksums] (checksum.py)
        sums = entry.get("checksums")
        odd = [] if sums is None else sorted(set(sums) ^ set(entry["tensors"]))
        _expect(not odd, label, f"{name}: checksums and tensors disagree about {len(odd)} keys, e.g. {odd[:1]}")
    rng = index.get("rng")
    if rng:
        _expect(rng["file"] in files, label, f"RNG file {rng['file']!r} is not in 'files'")


def _check_cover(
    pieces: list[Piece], numel: int, wanted: dict[str, str], files: dict[str, Any], label: str, where: str
) -> None:
    """`pieces` (sorted) cover [0, numel) exactly once and their files list every wanted tensor."""
    pos = 0
    for piece in pieces:
        _expect(piece.start == pos, label, f"{where}: elements [{pos}, {piece.start}) have no piece")
        _expect(piece.file in files, label, f"{where}: piece file {piece.file!r} is not in 'files'")
        tensors = files[piece.file]["tensors"]
        for key, dtype in wanted.items():
            got = tensors.get(key)
            _expect(
                got is not None and got[0] == dtype and list(got[1]) == [piece.length],
                label,
                f"{piece.file} should hold {key!r} as {dtype} [{piece.length}], the table says {got}",
            )
        pos += piece.length
    _expect(pos == numel, label, f"{where}: pieces cover {pos} of {numel} elements")


def recorded_checksums(index: dict[str, Any], wanted: Callable[[str], bool]) -> dict[str, dict[str, tuple[str, int]]]:
    """file -> key -> (checksum, nbytes) of the `wanted` tensors whose file records checksums."""
    out: dict[str, dict[str, tuple[str, int]]] = {}
    for name, entry in index["files"].items():
        sums = entry.get("checksums")
        if sums is None:
            continue  # written before checksums: loads unverified
        keys = {k: (str(sums[k]), tensor_nbytes(d, shape)) for k, (d, shape) in entry["tensors"].items() if wanted(k)}
        if keys:
            out[name] = keys
    return out


def file_expectations(index: dict[str, Any], name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    entry = index["files"][name]
    return {k: (str(v[0]), tuple(int(d) for d in v[1])) for k, v in entry["tensors"].items()}
