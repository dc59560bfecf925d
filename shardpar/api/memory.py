"""`smp.memory_metrics()`: this rank's memory, as SageMaker model-parallel v1 printed it; and the
hand-back of what wrapping freed (`release_freed_memory`).

On CUDA the allocator's current and peak allocated / reserved bytes; on CPU the process's resident
set (VmRSS) and its peak (VmHWM), read from /proc -- measured from outside our own bookkeeping.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

import torch

from shardpar.api.context import device, rank

_LOG = logging.getLogger("shardpar")
_MIB = 1024 * 1024


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def memory_metrics(*, log: bool = True) -> dict[str, float]:
    """This rank's memory in MiB: {"allocated", "max_allocated", "reserved", "max_reserved"} on CUDA,
    {"rss", "peak_rss"} on CPU (absent where /proc is not there). Logged as one line on the
    "shardpar" logger unless `log=False`."""
    dev = device()
    if dev.type == "cuda":
        metrics = {
            "allocated": torch.cuda.memory_allocated(dev) / _MIB,
            "max_allocated": torch.cuda.max_memory_allocated(dev) / _MIB,
            "reserved": torch.cuda.memory_reserved(dev) / _MIB,
            "max_reserved": torch.cuda.max_memory_reserved(dev) / _MIB,
        }
    else:
        metrics = {}
        for name, field in (("rss", "VmRSS"), ("peak_rss", "VmHWM")):
            kib = _proc_status_kib(field)
            if kib is not None:
                metrics[name] = kib / 1024
    if log:
        shown = ", ".join(f"{k} {v:.1f} MiB" for k, v in metrics.items())
        _LOG.warning("rank %d memory (%s): %s", rank(), dev, shown or "not measurable here")
    return metrics


# [Note: hand back what the wrap freed]
# Wrapping frees every rank's full copy of the model but its shard. On CPU, glibc keeps freed blocks
# below its mmap threshold (128 KiB, rising to 32 MiB as large blocks are freed: every weight of a
# 563M GPT-NeoX is below it) in the heap, where the shards allocated after them pin the heap's top:
# the full model stays resident for the rest of the run (bench_lora at 563m, 4 ranks: 1,371 MiB after
# the wrap, 691 MiB after malloc_trim). Once per wrap we ask glibc to return its free pages
# (malloc_trim(0) releases free pages inside the heap too, not only at its top; a millisecond
# or so); on CUDA the caching allocator's cached blocks go back to the driver. No gc.collect():
# the freed storages are not held by reference cycles (the same 691 MiB without it), and with
# transformers imported one collection takes ~0.17 s -- the test suite wraps hundreds of times.
# Where there is no malloc_trim (musl, macOS) nothing is done on CPU. Only a model of RELEASE_MIN_BYTES
# or more is worth it: a trim gives back pages that the next allocations fault in again, and the test
# suite's hundreds of small wraps paid for that (pytest +35 s) with nothing to give back.
RELEASE_MIN_BYTES = 64 << 20


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:  # the process's own symbols: libc's where it is glibc (no find_library, which runs ldconfig)
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


def release_freed_memory(model_bytes: int) -> None:
    """Return the memory the wrap of a model of `model_bytes` freed to the OS / driver ([Note: hand back
    what the wrap freed]); nothing below RELEASE_MIN_BYTES."""
    if model_bytes < RELEASE_MIN_BYTES:
        return
    if device().type == "cuda":
        torch.cuda.empty_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
