"""Spawned benchmark ranks: a free port, and their results collected in rank order (bench_step.py,
bench_memory.py)."""

from __future__ import annotations

import socket
import time
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def collect(procs: list[Any], queue: Any, world: int, timeout_s: float) -> list[Any]:
    """Each started rank puts (rank, "ok" | "err", value) on `queue`: their values in rank order, or
    RuntimeError naming a rank that failed, died or timed out. The ranks are joined (or ended) after."""
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks {sorted(set(range(world)) - set(results))} timed out")
            try:
                rank, kind, value = queue.get(timeout=0.5)
            except Exception:  # queue.Empty: check nobody died silently
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                continue
            if kind == "err":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30 if len(results) == world else 0.5)
            if p.is_alive():
                p.terminate()
                p.join()
    return [results[r] for r in range(world)]
