"""`smp.memory_metrics()`: this rank's memory, as SageMaker model-parallel v1 printed it.

On CUDA the allocator's current and peak allocated / reserved bytes; on CPU the process's resident
set (VmRSS) and its peak (VmHWM), read from /proc -- measured from outside our own bookkeeping.
"""

from __future__ import annotations

import logging

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
