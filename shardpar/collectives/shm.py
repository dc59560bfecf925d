"""Shared-memory intra-node transport for CPU tensors: a ctypes wrapper around `shardpar._shm`.

The C side (shardpar/csrc/shm_transport.c) moves data through one /dev/shm segment per communicator,
in 1 MiB chunks with futex waits, timeouts and dead-peer detection; see its [Note: shm segment layout].
Only the job's own user can create or attach a segment ([Note: shm trust]): a name taken by another
uid raises ShmForeignSegmentError naming the owner and /dev/shm path.
`ShmComm` is one communicator per process per group of local ranks; every rank of the group builds it
with the same `key`, `group` and `size`, and its own `index` (0..size-1, the "local index").

Shapes (n = size), as in shardpar.collectives.base:

    all_gather(out, inp):           inp [k]      -> out [n*k]   (block i of out is rank i's inp)
    reduce_scatter(out, inp, op):   inp [n*k]    -> out [k]     (rank i gets the reduced block i)
    reduce_scatter_spans(out, spans, op): the same, inp given as tensors / zero counts end to end
    all_reduce(t, op):              t [k]        -> t [k]       (in place)
    broadcast(t, src_index):        t [k]        -> t [k]       (in place, from local index src_index)

Reductions (fp32, bf16, fp16) add in fp32 in rank order and round once (round-to-nearest-even), so a
result equals `sum(inputs in rank order, in fp32).to(dtype)` bit for bit; "avg" divides that fp32 sum
by n before the rounding. Gathers and broadcasts copy bytes, so they take any dtype.

ctypes releases the GIL around every call, so a communicator may run on a background thread; one
communicator is used by one thread at a time (the caller serialises).
"""

from __future__ import annotations

import ctypes
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shardpar.collectives.failures import host_id

__all__ = [
    "ShmComm",
    "ShmError",
    "ShmForeignSegmentError",
    "ShmPeerError",
    "ShmTimeoutError",
    "available",
    "best_isa",
    "host_id",
    "reduce_kernel",
    "segment_name",
]

_OK, _EINVAL, _ESYS, _ETIMEDOUT, _EPEERDEAD, _EPEERGONE, _EMISMATCH, _EFOREIGN = 0, -1, -2, -3, -4, -5, -6, -7
# How the C transport names a peer in its messages ("rank 1 (local index) ...", "reported by rank 0").
_LOCAL_RANK = re.compile(r"\brank (\d+) \(local index")
_REPORTER = re.compile(r"reported by rank (\d+)")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_OPS = {"sum": 0, "avg": 1}
_ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
DEFAULT_CHUNK_BYTES = 1 << 20


class ShmError(RuntimeError):
    """A shared-memory collective failed; the communicator is aborted on every rank.

    `culprit` is the rank the transport blames (its global rank when the communicator knows its
    members, else its local index), None when it blames nobody."""

    def __init__(self, message: str, culprit: int | None = None) -> None:
        super().__init__(message)
        self.culprit = culprit


class ShmTimeoutError(ShmError, TimeoutError):
    """A peer did not arrive within the timeout; the message names its local index."""


class ShmPeerError(ShmError):
    """A peer process died (or closed its communicator) while others waited for it."""


class ShmForeignSegmentError(ShmError, PermissionError):
    """The segment's name is taken by a segment this job does not own ([Note: shm trust] in
    shm_transport.c); the message names its owner and path. It was neither attached nor removed."""


def _find_library() -> Path | None:
    package_dir = Path(__file__).resolve().parent.parent
    candidates = sorted(package_dir.glob("_shm*.so"))
    return candidates[0] if candidates else None


def _load() -> tuple[ctypes.CDLL | None, str]:
    if not sys.platform.startswith("linux"):
        return None, f"the shm transport needs Linux (futex, /dev/shm); this is {sys.platform}"
    if not Path("/dev/shm").is_dir():
        return None, "/dev/shm is not mounted (in a container: mount a tmpfs there, e.g. docker --shm-size)"
    path = _find_library()
    if path is None:
        return None, "shardpar/_shm*.so is not built: run `pip install -e .` (needs a C compiler)"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"cannot load {path}: {exc}"
    _declare(lib)
    return lib, ""


def _declare(lib: ctypes.CDLL) -> None:
    vp, u64, i, d = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_double
    signatures: dict[str, tuple[Any, list[Any]]] = {
        "shm_comm_create": (vp, [ctypes.c_char_p, i, i, u64, d, ctypes.POINTER(i), ctypes.c_char_p, ctypes.c_size_t]),
        "shm_comm_destroy": (None, [vp]),
        "shm_comm_last_error": (ctypes.c_char_p, [vp]),
        "shm_comm_set_timeout": (i, [vp, d]),
        "shm_comm_set_wait": (i, [vp, i]),
        "shm_comm_all_gather": (i, [vp, vp, vp, u64]),
        "shm_comm_reduce_scatter": (i, [vp, vp, vp, u64, i, i]),
        "shm_comm_reduce_scatter_spans": (i, [vp, vp, vp, u64, u64, i, i]),
        "shm_comm_all_reduce": (i, [vp, vp, u64, i, i]),
        "shm_comm_broadcast": (i, [vp, vp, u64, i]),
        "shm_comm_barrier": (i, [vp]),
        "shm_reduce": (i, [vp, ctypes.POINTER(vp), i, u64, i, i, i]),
        "shm_best_isa": (i, []),
        "shm_copy": (None, [vp, vp, u64, i]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes


_LIB, _WHY_NOT = _load()


def available() -> tuple[bool, str]:
    """(True, "") when the transport can be used, else (False, the reason)."""
    return _LIB is not None, _WHY_NOT


def _lib() -> ctypes.CDLL:
    if _LIB is None:
        raise RuntimeError(f"shm transport unavailable: {_WHY_NOT}")
    return _LIB


def best_isa() -> str:
    """The reduction kernels in use: "avx512", "avx2" or "scalar" (env SHARDPAR_SHM_ISA can lower it)."""
    code = _lib().shm_best_isa()
    return next(name for name, c in _ISAS.items() if c == code)


def segment_name(key: str, group: str | int) -> str:
    """The /dev/shm name of a communicator: `shardpar-<key>-<group>`. `key` must be unique per job and a
    secret until the segment exists: another local user who guesses a name first can fail the job
    (never attach; see [Note: shm trust] in shm_transport.c), so callers derive it from a random secret
    exchanged over their process group."""
    for what, value in (("key", key), ("group", str(group))):
        if not _NAME_RE.match(value):
            raise ValueError(f"shm {what} {value!r} may only hold letters, digits, '_', '.' and '-'")
    name = f"shardpar-{key}-{group}"
    if len(name) > 200:
        raise ValueError(f"shm segment name {name!r} is {len(name)} chars; keep key and group under 200 together")
    return name


def _raise(status: int, message: str, members: Sequence[int] | None = None) -> None:
    """The exception for a transport status; the first peer the message names is the culprit."""
    named = _LOCAL_RANK.search(message)
    culprit = None if named is None else int(named[1]) if members is None else members[int(named[1])]
    if status == _ETIMEDOUT:
        raise ShmTimeoutError(_name_members(message, members), culprit)
    if status in (_EPEERDEAD, _EPEERGONE):
        raise ShmPeerError(_name_members(message, members), culprit)
    if status == _EMISMATCH:
        raise ShmError(_name_members(message, members), culprit)
    if status == _EFOREIGN:
        raise ShmForeignSegmentError(message)
    if status == _EINVAL:
        raise ValueError(message)
    raise ShmError(message)


def _name_members(message: str, members: Sequence[int] | None) -> str:
    """The transport names peers by local index; add each one's global rank when it is known."""
    if members is None:
        return message
    message = _LOCAL_RANK.sub(lambda m: f"global rank {members[int(m[1])]} (local index {m[1]}", message)
    return _REPORTER.sub(lambda m: f"reported by global rank {members[int(m[1])]}", message)


def _dtype_code(t: torch.Tensor, op: str) -> int:
    if t.dtype not in _DTYPES:
        raise TypeError(f"shm {op}: dtype {t.dtype} is not reducible; use float32, bfloat16 or float16")
    return _DTYPES[t.dtype]


def _op_code(op: str) -> int:
    if op not in _OPS:
        raise ValueError(f"shm reduction op {op!r} is not one of {tuple(_OPS)}")
    return _OPS[op]


def _check_cpu_contiguous(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(
                f"shm {op}: {name} must be a contiguous CPU tensor (got device {t.device}, "
                f"contiguous={t.is_contiguous()}); use .contiguous() / .cpu()"
            )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _overlaps(a: int, a_bytes: int, b: int, b_bytes: int) -> bool:
    return a_bytes > 0 and b_bytes > 0 and a < b + b_bytes and b < a + a_bytes


def reduce_kernel(out: torch.Tensor, inputs: list[torch.Tensor], op: str = "sum", *, isa: str | None = None) -> None:
    """out = inputs[0] + inputs[1] + ... in fp32, rounded once (the transport's kernel, for tests)."""
    code = _dtype_code(out, "reduce")
    if any(t.dtype != out.dtype or t.numel() != out.numel() for t in inputs):
        raise ValueError("reduce: every input needs the output's dtype and numel")
    _check_cpu_contiguous("reduce", out=out, **{f"inputs[{i}]": t for i, t in enumerate(inputs)})
    srcs = (ctypes.c_void_p * len(inputs))(*[t.data_ptr() for t in inputs])
    status = _lib().shm_reduce(
        out.data_ptr(), srcs, len(inputs), out.numel(), code, _op_code(op), -1 if isa is None else _ISAS[isa]
    )
    if status != _OK:
        raise ValueError(f"reduce: kernel {isa!r} is not available on this CPU (best: {best_isa()!r})")


def stream_copy(out: torch.Tensor, inp: torch.Tensor, *, non_temporal: bool = True) -> None:
    """out = inp (same nbytes, no overlap) with the transport's copy routine (for benchmarks: the floor
    of what a collective's copies can reach on this machine)."""
    _check_cpu_contiguous("stream_copy", out=out, inp=inp)
    if _nbytes(out) != _nbytes(inp) or _overlaps(out.data_ptr(), _nbytes(out), inp.data_ptr(), _nbytes(inp)):
        raise ValueError("stream_copy: out and inp need the same number of bytes and must not overlap")
    _lib().shm_copy(out.data_ptr(), inp.data_ptr(), _nbytes(out), int(non_temporal))


MAX_TIMEOUT_S = 1e6  # the longest wait the transport takes (MAX_TIMEOUT_S in shm_transport.c)


class ShmComm:
    """A shared-memory communicator among `size` local ranks; this process is local index `index`.

    Construction blocks until all `size` ranks attached (or raises ShmTimeoutError after `timeout_s`).
    `timeout_s` also bounds every wait inside a collective. After any failure the communicator is
    aborted on every rank; `close()` it and build a new one (with a new `group`) to go on.
    """

    def __init__(
        self,
        key: str,
        group: str | int,
        index: int,
        size: int,
        *,
        timeout_s: float = 300.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        members: Sequence[int] | None = None,
    ) -> None:
        self._handle: int | None = None
        if not 0 <= index < size:
            raise ValueError(f"shm: local index {index} must be in [0, size={size})")
        if members is not None and len(members) != size:
            raise ValueError(f"shm: members {list(members)} must name {size} global ranks, one per local index")
        # Global rank of each local index: errors name the rank a user can find in the launcher's logs.
        self.members = list(members) if members is not None else None
        self.name = segment_name(key, group)
        self.index, self.size, self.timeout_s = index, size, timeout_s
        self.patient = False
        lib = _lib()
        status = ctypes.c_int(0)
        err = ctypes.create_string_buffer(1024)
        handle = lib.shm_comm_create(
            ("/" + self.name).encode(), index, size, chunk_bytes, timeout_s, ctypes.byref(status), err, len(err)
        )
        if not handle:
            _raise(status.value, err.value.decode(errors="replace"), self.members)
        self._handle = handle

    # ---- life cycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap the segment (local; peers still waiting on this rank get ShmPeerError)."""
        if self._handle is not None and _LIB is not None:
            _LIB.shm_comm_destroy(self._handle)
        self._handle = None

    def __enter__(self) -> ShmComm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def set_timeout(self, timeout_s: float) -> None:
        self._check(_lib().shm_comm_set_timeout(self._live(), timeout_s))
        self.timeout_s = timeout_s

    def set_patient(self, patient: bool) -> None:
        """patient: waits inside a collective sleep at once (no spinning, no yielding), leaving the
        cores to compute that runs beside the collective; else the default (spin when every rank has
        a core). See [Note: shm synchronisation] in shm_transport.c."""
        if patient != self.patient:
            self._check(_lib().shm_comm_set_wait(self._live(), int(patient)))
            self.patient = patient

    def _live(self) -> int:
        if self._handle is None:
            raise ValueError(f"shm communicator {self.name} is closed")
        return self._handle

    def _check(self, status: int) -> None:
        if status != _OK:
            _raise(status, _lib().shm_comm_last_error(self._handle).decode(errors="replace"), self.members)

    # ---- collectives -----------------------------------------------------------------------------

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """out[i*k:(i+1)*k] = inp of local index i; any dtype; inp may be out's own block."""
        _check_cpu_contiguous("all_gather", out=out, inp=inp)
        if out.dtype != inp.dtype or out.numel() != self.size * inp.numel():
            raise ValueError(
                f"shm all_gather: out ({out.dtype}, {out.numel()} elements) must be {self.size} x "
                f"inp ({inp.dtype}, {inp.numel()} elements)"
            )
        nbytes, out_ptr, inp_ptr = _nbytes(inp), out.data_ptr(), inp.data_ptr()
        if _overlaps(out_ptr, self.size * nbytes, inp_ptr, nbytes) and inp_ptr != out_ptr + self.index * nbytes:
            raise ValueError("shm all_gather: inp overlaps out other than as out's own block")
        self._check(_lib().shm_comm_all_gather(self._live(), out_ptr, inp_ptr, nbytes))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum") -> None:
        """out = reduction over ranks of block `index` of inp (inp has size * out.numel() elements)."""
        _check_cpu_contiguous("reduce_scatter", out=out, inp=inp)
        code = _dtype_code(inp, "reduce_scatter")
        if out.dtype != inp.dtype or inp.numel() != self.size * out.numel():
            raise ValueError(
                f"shm reduce_scatter: inp ({inp.dtype}, {inp.numel()} elements) must be {self.size} x "
                f"out ({out.dtype}, {out.numel()} elements)"
            )
        nbytes, out_ptr, inp_ptr = _nbytes(out), out.data_ptr(), inp.data_ptr()
        if _overlaps(out_ptr, nbytes, inp_ptr, self.size * nbytes) and out_ptr != inp_ptr + self.index * nbytes:
            raise ValueError("shm reduce_scatter: out overlaps inp other than as inp's own block")
        lib = _lib()
        self._check(lib.shm_comm_reduce_scatter(self._live(), out_ptr, inp_ptr, out.numel(), code, _op_code(op)))

    def reduce_scatter_spans(self, out: torch.Tensor, spans: Sequence[torch.Tensor | int], op: str = "sum") -> None:
        """reduce_scatter with the input given as spans laid end to end -- 1-D contiguous tensors of
        out's dtype, or an int k for k zeros -- read in place, never concatenated ([Note: shm spans])."""
        _check_cpu_contiguous("reduce_scatter", out=out)
        code = _dtype_code(out, "reduce_scatter")
        out_ptr, out_bytes = out.data_ptr(), _nbytes(out)
        words: list[int] = []  # (pointer, count) pairs: the C shm_span array
        for i, span in enumerate(spans):
            if isinstance(span, int):
                if span < 0:
                    raise ValueError(f"shm reduce_scatter: span {i} asks for {span} zeros; a count must be >= 0")
                words += (0, span)
                continue
            _check_cpu_contiguous("reduce_scatter", **{f"spans[{i}]": span})
            if span.dtype != out.dtype:
                raise ValueError(f"shm reduce_scatter: spans[{i}] is {span.dtype}, out is {out.dtype}; cast it first")
            if _overlaps(out_ptr, out_bytes, span.data_ptr(), _nbytes(span)):
                raise ValueError(f"shm reduce_scatter: spans[{i}] overlaps out; reduce into a separate tensor")
            words += (span.data_ptr(), span.numel())
        total = sum(words[1::2])
        if total != self.size * out.numel():
            raise ValueError(
                f"shm reduce_scatter: the spans hold {total} elements but must hold {self.size} x "
                f"out ({out.numel()} elements); pad with an int span of zeros"
            )
        array = (ctypes.c_uint64 * len(words))(*words)
        lib = _lib()
        self._check(
            lib.shm_comm_reduce_scatter_spans(
                self._live(), out_ptr, array, len(words) // 2, out.numel(), code, _op_code(op)
            )
        )

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        """t = reduction of t over ranks, in place."""
        _check_cpu_contiguous("all_reduce", t=t)
        code = _dtype_code(t, "all_reduce")
        self._check(_lib().shm_comm_all_reduce(self._live(), t.data_ptr(), t.numel(), code, _op_code(op)))

    def broadcast(self, t: torch.Tensor, src_index: int) -> None:
        """t = t of local index `src_index`, in place; any dtype."""
        _check_cpu_contiguous("broadcast", t=t)
        self._check(_lib().shm_comm_broadcast(self._live(), t.data_ptr(), _nbytes(t), src_index))

    def barrier(self) -> None:
        self._check(_lib().shm_comm_barrier(self._live()))
