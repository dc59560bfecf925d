"""Pluggable collective engines (docs/design.md section 9): native torch.distributed, smddp."""

from __future__ import annotations

import warnings

from shardpar.collectives.base import CompletedWork, Engine, Group, ReduceOp, Span, Work
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
    "Span",
    "Work",
    "make_engine",
]

_WARNED: set[str] = set()


def make_engine(
    backend: str,
    *,
    timeout_s: float = 300.0,
    ranks_per_node: int | None = None,
    ag_scratch_bytes: int | None = None,
    ag_sort_bytes: int | None = None,
    device_type: str = "cpu",
    hierarchical_allgather: bool = True,
) -> Engine:
    """The engine for a `ddp_dist_backend` value.

    "nccl" is native torch.distributed (NCCL on GPU, gloo on CPU); "smddp" the shared-memory engine
    (native when its C extension is missing, with one warning saying why); "auto" smddp for CPU
    training when the extension is available, else native. Building an smddp engine is collective
    over the world (it agrees on a job key). None options are read from LOCAL_WORLD_SIZE and the
    SMDDP_AG_* environment variables. `hierarchical_allgather` is `sdp_hierarchical_allgather`: off,
    the smddp engine gathers over groups spanning nodes natively instead of hierarchically.
    """
    if backend not in ("auto", "nccl", "smddp"):
        raise ValueError(f"ddp_dist_backend={backend!r} is not one of ('auto', 'nccl', 'smddp')")
    native = NativeEngine(timeout_s=timeout_s)
    if backend == "nccl":
        return native
    from shardpar.collectives import shm

    if backend == "auto" and device_type != "cpu":
        return native
    ok, why = _agree_on_shm(*shm.available())
    if backend == "auto" and not ok:
        return native
    if not ok:
        _warn_once(f"ddp_dist_backend='smddp': {why}; using the native torch.distributed engine")
        return native
    from shardpar.collectives.smddp import SmddpEngine, SmddpOptions

    options = SmddpOptions(
        timeout_s, ranks_per_node, ag_scratch_bytes, ag_sort_bytes, hierarchical_allgather=hierarchical_allgather
    )
    return SmddpEngine(options=options, native=native)


def _agree_on_shm(ok: bool, why: str) -> tuple[bool, str]:
    """Whether the shm transport works on every rank, decided together: a rank that went native alone
    would leave the others in the smddp engine's first collective until their timeout."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ok, why
    replies: list[tuple[bool, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(replies, (ok, why))
    for rank, reply in enumerate(replies):
        if reply is not None and not reply[0]:
            return False, f"rank {rank}: {reply[1]}"
    return True, ""


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)
