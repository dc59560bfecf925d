"""Safetensors files written one tensor at a time, and headers read back and checked before any load.

Format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N, N bytes
of JSON, then the tensor bytes end to end:

    | N (u64) | {"__metadata__": {...}, "key": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}} | data |

Every offset is known from the (key, dtype, shape) list alone, so `SafetensorsWriter` writes the header
first and the tensors as they arrive: a full-model export streams unit by unit and never holds more
than one unit's parameters (safetensors.torch.save_file needs every tensor at once and copies them).
Reading uses `safetensors.safe_open` (lazy, slice-wise, and never executes code: no pickle).
The writer also checksums each tensor's bytes as they go out (checksum.py); the checksums go into our
index / manifest, not into this header, which is written before the data.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from shardpar.checkpoint import checksum

_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPES = {v: k for k, v in _NAMES.items()}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, truncated or mismatched files, or a model mismatch."""


def misfit(directory: Path, problems: list[str]) -> CheckpointError:
    """The error for a checkpoint whose parameters do not fit the model (its first ten problems)."""
    more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
    return CheckpointError(f"{directory}: checkpoint does not fit the model:\n  " + "\n  ".join(problems[:10]) + more)


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _NAMES:
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors; supported: {sorted(map(str, _NAMES))}")
    return _NAMES[dtype]


def dtype_of(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise CheckpointError(f"unknown safetensors dtype {name!r}")
    return _DTYPES[name]


@dataclass(frozen=True)
class TensorEntry:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty(0, dtype=self.dtype).element_size()


def _header_bytes(entries: Sequence[TensorEntry], metadata: Mapping[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for e in entries:
        if e.key in header or e.key == "__metadata__":
            raise ValueError(f"safetensors key {e.key!r} appears twice")
        header[e.key] = {
            "dtype": dtype_name(e.dtype),
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # tensor data 8-byte aligned, as safetensors writes it


class SafetensorsWriter:
    """Writes `entries` into `path` in the given order; `write` each tensor once, then `close`."""

    def __init__(self, path: str | os.PathLike[str], entries: Sequence[TensorEntry], metadata: Mapping[str, str]):
        self.path = Path(path)
        self._entries = list(entries)
        self._next = 0
        self.checksums: dict[str, str] = {}  # key -> checksum.text of its bytes, filled by close()
        self._sums = checksum.Background()
        header = _header_bytes(self._entries, metadata)
        self._file = open(self.path, "wb")  # noqa: SIM115 -- closed by close() / __exit__
        self._file.write(struct.pack("<Q", len(header)))
        self._file.write(header)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._entries):
            raise AssertionError(f"{self.path.name}: tensor {key!r} written after the last entry")
        entry = self._entries[self._next]
        if (key, tensor.dtype, tuple(tensor.shape)) != (entry.key, entry.dtype, entry.shape):
            raise AssertionError(
                f"{self.path.name}: expected {entry.key} {entry.dtype} {entry.shape}, got {key} {tensor.dtype} "
                f"{tuple(tensor.shape)}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        raw = data.view(torch.uint8).numpy().data  # no copy: the buffer itself
        self._sums.add(key, raw, data)  # hashed while it is written ([Note: checkpoint checksums])
        if data.numel():
            self._file.write(raw)
        self._next += 1

    def settle(self) -> None:
        """Wait for the checksums of the tensors written so far, so their buffers may be freed."""
        self._sums.settle()

    def close(self) -> int:
        """Flush and fsync; the file's size in bytes."""
        if self._next != len(self._entries):
            self.abandon()
            missing = [e.key for e in self._entries[self._next :]]
            raise AssertionError(f"{self.path.name}: {len(missing)} tensors never written, first {missing[0]!r}")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.checksums = self._sums.finish()
        return self.path.stat().st_size

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is not None:
            self.abandon()

    def abandon(self) -> None:
        """Close the file without checking it (after an error; the directory is discarded)."""
        self._sums.close()
        self._file.close()


@dataclass(frozen=True)
class Written:
    """A finished file: its size and each tensor's checksum (checksum.text)."""

    bytes: int
    checksums: dict[str, str]


def write_tensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> Written:
    """Write `tensors` (in order) to `path`."""
    entries = [TensorEntry(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    with SafetensorsWriter(path, entries, metadata) as w:
        for k, t in tensors.items():
            w.write(k, t)
        return Written(w.close(), w.checksums)


# ---- reading and checking ------------------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    metadata: dict[str, str]
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # key -> (dtype name, shape)
    spans: dict[str, tuple[int, int]]  # key -> [begin, end) of its bytes in the file (header included)


def read_header(path: Path, *, label: str) -> Header:
    """Parse and bounds-check `path`'s header; `label` names the file in errors."""
    if not path.is_file():
        raise CheckpointError(f"{label}: file is missing")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{label}: truncated ({size} bytes, shorter than a safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER_BYTES):
            raise CheckpointError(f"{label}: truncated or corrupt (header says {n} bytes, file has {size})")
        try:
            raw = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{label}: corrupt safetensors header ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{label}: corrupt safetensors header (not a JSON object)")
    metadata = raw.pop("__metadata__", None) or {}
    data_bytes, end = size - 8 - n, 0
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    spans: dict[str, tuple[int, int]] = {}
    for key, info in raw.items():
        try:
            begin, stop = (int(x) for x in info["data_offsets"])
            tensors[key] = (str(info["dtype"]), tuple(int(d) for d in info["shape"]))
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{label}: corrupt safetensors header entry {key!r}") from None
        if not 0 <= begin <= stop:
            raise CheckpointError(f"{label}: corrupt offsets for {key!r}")
        spans[key] = (8 + n + begin, 8 + n + stop)
        end = max(end, stop)
    if end > data_bytes:
        raise CheckpointError(f"{label}: truncated: tensor data needs {end} bytes, the file holds {data_bytes}")
    return Header(dict(metadata), tensors, spans)


def check_file(
    path: Path,
    *,
    label: str,
    expect_bytes: int | None,
    expect_tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    expect_metadata: Mapping[str, str],
) -> None:
    """Raise CheckpointError naming `label` unless the file matches what the index recorded."""
    if not path.is_file():
        raise CheckpointError(f"{label}: file is missing")
    size = path.stat().st_size
    if expect_bytes is not None and size != expect_bytes:
        kind = "truncated" if size < expect_bytes else "size mismatch"
        raise CheckpointError(f"{label}: {kind}: {size} bytes on disk, the index records {expect_bytes}")
    header = read_header(path, label=label)
    for k, v in expect_metadata.items():
        if header.metadata.get(k) != v:
            raise CheckpointError(
                f"{label}: belongs to another checkpoint ({k}={header.metadata.get(k)!r}, the index says {v!r})"
            )
    missing = sorted(set(expect_tensors) - set(header.tensors))
    if missing:
        raise CheckpointError(f"{label}: {len(missing)} tensors listed in the index are missing, e.g. {missing[0]!r}")
    for key, want in expect_tensors.items():
        got = header.tensors[key]
        if (got[0], tuple(got[1])) != (want[0], tuple(want[1])):
            raise CheckpointError(
                f"{label}: tensor {key!r} is {got[0]} {list(got[1])}, the index says {want[0]} {list(want[1])}"
            )


# ---- checksums ([Note: checkpoint checksums] in checksum.py) ---------------------------------------

_CHUNK = 8 * 1024 * 1024


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor recorded as (safetensors dtype name, shape)."""
    return TensorEntry("", dtype_of(dtype), tuple(int(d) for d in shape)).nbytes


def verify_tensors(path: Path, *, label: str, expected: Mapping[str, str]) -> None:
    """Hash the bytes of every tensor in `expected` (key -> recorded checksum) as they are on disk;
    CheckpointError naming the file and the tensor on the first mismatch."""
    header = read_header(path, label=label)
    missing = sorted(set(expected) - set(header.spans))
    if missing:
        raise CheckpointError(f"{label}: {len(missing)} checksummed tensors are missing, e.g. {missing[0]!r}")
    view = memoryview(bytearray(_CHUNK))
    with open(path, "rb", buffering=0) as f:
        for key in sorted(expected, key=lambda k: header.spans[k]):
            try:
                algorithm = checksum.parse(expected[key], where=f"{label}: tensor {key!r}")
            except ValueError as e:
                raise CheckpointError(str(e)) from None
            value, fold = checksum.hasher(algorithm)
            begin, end = header.spans[key]
            f.seek(begin)
            while begin < end:
                n = f.readinto(view[: min(end - begin, _CHUNK)])
                if not n:
                    raise CheckpointError(f"{label}: truncated inside tensor {key!r}")
                value, begin = fold(view[:n], value), begin + n
            got = checksum.text(value, algorithm)
            if got != expected[key]:
                raise CheckpointError(
                    f"{label}: tensor {key!r}: checksum mismatch ({got} on disk, {expected[key]} recorded when it "
                    "was saved): its data is corrupt, so nothing was loaded; restore the file from a copy or resume "
                    "another tag"
                )


def verify_share(
    directory: Path, recorded: Mapping[str, Mapping[str, tuple[str, int]]], *, rank: int, world: int
) -> None:
    """Verify this rank's share of `recorded` (file -> key -> (checksum, nbytes)); the ranks' shares
    cover every tensor once (checksum.share), and the caller's check phase makes them agree."""
    items = [(file, key, nbytes) for file, keys in recorded.items() for key, (_, nbytes) in keys.items()]
    mine: dict[str, dict[str, str]] = {}
    for file, key in checksum.share(items, rank, world):
        mine.setdefault(file, {})[key] = recorded[file][key][0]
    for file, expected in mine.items():
        verify_tensors(directory / file, label=f"{directory}/{file}", expected=expected)
