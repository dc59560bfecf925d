"""Pluggable collective engines (DESIGN.md section 1): native torch.distributed, smddp."""

import warnings

from shardpar.collectives.base import CompletedWork, Engine, Group, ReduceOp, Work
from shardpar.collectives.native import NativeEngine
from shardpar.collectives.stats import CommRecord, CommStats, CountingEngine

__all__ = [
    "CommRecord",
    "CommStats",
    "CompletedWork",
    "CountingEngine",
    "Engine",
    "Group",
    "NativeEngine",
    "ReduceOp",
    "Work",
    "make_engine",
]


def make_engine(backend: str, *, timeout_s: float = 300.0) -> Engine:
    """The engine for a `ddp_dist_backend` value ("nccl" means native torch.distributed)."""
    if backend not in ("auto", "nccl", "smddp"):
        raise ValueError(f"ddp_dist_backend={backend!r} is not one of ('auto', 'nccl', 'smddp')")
    if backend == "smddp":
        warnings.warn(
            "ddp_dist_backend='smddp': the smddp engine is not part of this build yet; using the native "
            "torch.distributed engine",
            stacklevel=2,
        )
    return NativeEngine(timeout_s=timeout_s)
