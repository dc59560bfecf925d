"""`smp.save(obj, f, partial=True)` / `smp.load(f, partial=True)`: SageMaker v1's torch.save-alike,
pickle-free.

One safetensors file per call: the tensors (and numpy arrays) of `obj` as its entries, and the rest of
the structure as JSON in the file's metadata (checkpoint/objects.py), so loading never runs code and
`safetensors` can read the tensors of any file. With `partial=True` each rank whose local state
differs writes its own file, `<f>_<mp_rank>` (SMP v1's name), or `<f>_<mp_rank>_<sdp_rank>` when
parameters are sharded; ranks that hold the same state (replicas) write the same bytes, and each
write is atomic (a temporary file renamed into place), so a replica's concurrent save is harmless.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from shardpar.api.context import is_initialized, sdp_rank, sdp_size, tp_rank
from shardpar.checkpoint import objects
from shardpar.v1_notes import note_once

_META_KEY = "shardpar.save"
_FORMAT = "shardpar.save/1"

MapLocation = str | torch.device | Mapping[str, str] | Callable[[torch.Tensor, str], Any] | None


def _path(f: str | os.PathLike[str], partial: bool) -> Path:
    if not isinstance(f, (str, os.PathLike)):
        raise TypeError(f"smp.save/smp.load take a file name (str or path), got {type(f).__name__}")
    if not partial:
        return Path(f)
    if not is_initialized():
        raise RuntimeError("smp.save/smp.load with partial=True name the file by rank: call smp.init() first")
    suffix = f"_{tp_rank()}" if sdp_size() == 1 else f"_{tp_rank()}_{sdp_rank()}"
    return Path(os.fspath(f) + suffix)


def save(
    obj: Any,
    f: str | os.PathLike[str],
    partial: bool = True,
    pickle_module: Any = None,
    pickle_protocol: int = 2,
    v3: bool = False,
) -> None:
    """Save `obj` (tensors, numpy arrays, dicts/lists/tuples of them and plain values) to `f`, or to this
    rank's partial file. `pickle_module` / `pickle_protocol` are SMP v1's and ignored: nothing is pickled.
    v1's `v3=True` (each rdp rank's own optimizer piece, in `<f>_<pp>_<tp>_<rdp>`) is accepted with one
    rank-0 log line: the file names stay this function's, and smp.load reads them back."""
    if not isinstance(v3, bool):
        raise TypeError(f"smp.save(v3={v3!r}): pass True or False")
    if v3:
        note_once(
            "smp.save(v3=True)",
            "the files are named as smp.save always names them (<f>_<tp_rank>, or <f>_<tp_rank>_<sdp_rank> when "
            "parameters are sharded), not v1's <f>_<pp>_<tp>_<rdp>; read them with smp.load(f, partial=True), not "
            "torch.load. Each rank's optimizer.local_state_dict() already holds only its own piece",
        )
    tensors: dict[str, torch.Tensor] = {}

    def put(t: torch.Tensor, where: str) -> dict[str, str]:
        name = f"t{len(tensors)}"
        tensors[name] = t.detach().to("cpu").contiguous().clone()  # own storage: safetensors refuses shared ones
        return {"__tensor__": name, "device": t.device.type}

    skeleton = objects.encode(obj, "obj", put)
    path = _path(f, partial)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": _FORMAT, _META_KEY: json.dumps(skeleton, allow_nan=False)}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        safetensors.torch.save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(
    f: str | os.PathLike[str],
    map_location: MapLocation = None,
    pickle_module: Any = None,
    partial: bool = True,
    **pickle_load_args: Any,
) -> Any:
    """The object `smp.save` wrote to `f` (or this rank's partial file). Tensors come back on the CPU
    unless `map_location` (a device, a {"from": "to"} dict or a function(tensor, "cpu")) says otherwise."""
    path = _path(f, partial)
    if not path.is_file():
        raise FileNotFoundError(
            f"smp.load: {str(path)!r} does not exist" + (" (this rank's partial file)" if partial else "")
        )
    with safetensors.safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        if metadata.get("format") != _FORMAT or _META_KEY not in metadata:
            raise ValueError(f"smp.load: {str(path)!r} was not written by smp.save (no {_META_KEY!r} metadata)")
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 - not a dict

    def get(ref: Any) -> torch.Tensor:
        return _place(tensors[ref["__tensor__"]], map_location)

    return objects.decode(json.loads(metadata[_META_KEY]), get)


def _place(t: torch.Tensor, map_location: MapLocation) -> torch.Tensor:
    if map_location is None:
        return t
    if isinstance(map_location, (str, torch.device)):
        return t.to(map_location)
    if isinstance(map_location, Mapping):
        return t.to(map_location.get("cpu", "cpu"))
    moved = map_location(t, "cpu")
    return moved if isinstance(moved, torch.Tensor) else t
