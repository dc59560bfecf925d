"""A torch.distributed.checkpoint (DCP) directory read and written offline, in one process, for
`shardpar convert` (convert.py).

Reading never runs pickled code. DCP's `.metadata` is a pickle, and `dcp.load` reads non-tensor values
with `torch.load(weights_only=False)`: either could run code that a crafted checkpoint carries. Here
the metadata goes through an unpickler that builds only DCP's own metadata classes and the few torch
and pathlib names they hold (anything else raises, naming it), tensors and values through
`torch.load(weights_only=True)`. Every chunk's bytes are read from its file at the offset the
metadata records and placed into the full tensor at the chunk's offsets (chunks of any shape: FSDP2's
row blocks, shardpar's boxes, runtime/dcp_chunks.py).

Writing uses DCP's own writer (`dcp.save(..., no_dist=True)`), so the directory is what DCP writes."""

from __future__ import annotations

import io
import itertools
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch

METADATA = ".metadata"

# What DCP's .metadata may name, besides torch dtypes (module, name).
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.strided, rebuilt from its name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module, name) in _ALLOWED
            or module == "torch.distributed.checkpoint.metadata"
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"DCP metadata names {module}.{name}, which is not part of DCP's metadata: refusing to load it "
                "(it could run code). Convert only checkpoints written by torch.distributed.checkpoint"
            )
        return super().find_class(module, name)


def is_dcp(path: Path) -> bool:
    return (path / METADATA).is_file()


def read_metadata(path: Path) -> Any:
    with open(path / METADATA, "rb") as f:
        return _MetadataUnpickler(f).load()


def _item(path: Path, info: Any) -> Any:
    if getattr(info, "transform_descriptors", None):
        raise ValueError(
            f"{path}/{info.relative_path}: an item stored with transforms {info.transform_descriptors} "
            "(compression or encryption); convert reads plain DCP items only: load and re-save it with dcp"
        )
    with open(path / info.relative_path, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def read(path: Path) -> dict[str, Any]:
    """The nested state dict the directory was saved from (as the saver passed it: {"model": {...},
    "optim": {"state": ..., "param_groups": [...]}} for torch's get_state_dict), full tensors on the CPU."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = read_metadata(path)
    flat: dict[str, Any] = {}
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            flat[fqn] = _item(path, md.storage_data[_index(md, fqn, None)])
            continue
        full = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for chunk in entry.chunks:
            value = _item(path, md.storage_data[_index(md, fqn, chunk.offsets)])
            box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
            full[box] = value.view(tuple(chunk.sizes))
        flat[fqn] = full
    return _unflatten(flat, getattr(md, "planner_data", None) or {})


def _index(md: Any, fqn: str, offsets: Any) -> Any:
    """The storage key of `fqn`'s chunk at `offsets` (DCP keys items by fqn and offset; `index` is a hint)."""
    for key in md.storage_data:
        if key.fqn == fqn and (offsets is None or tuple(key.offset or ()) == tuple(offsets)):
            return key
    raise ValueError(f"DCP metadata has no stored item for {fqn!r} at {offsets}: the directory is incomplete")


def _unflatten(flat: dict[str, Any], paths: dict[str, Any]) -> dict[str, Any]:
    """DCP flattens nested dicts and lists to dotted keys and records each key's path (planner_data);
    FQNs hold dots themselves, so the recorded path is the only way back."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        path = tuple(paths.get(key, (key,)))
        node: Any = out
        for part, nxt in itertools.pairwise(path):
            empty: Any = [] if isinstance(nxt, int) else {}
            if isinstance(node, list):
                while len(node) <= part:
                    node.append(None)
                if node[part] is None:
                    node[part] = empty
                node = node[part]
            else:
                node = node.setdefault(part, empty)
        last = path[-1]
        if isinstance(node, list):
            while len(node) <= last:
                node.append(None)
        node[last] = value
    return out


def write(path: Path, state_dict: dict[str, Any]) -> None:
    """Save a nested state dict of plain tensors and values as a DCP directory, in this one process."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": so it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
