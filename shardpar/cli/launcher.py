"""A local launcher: run a function on N ranks of this machine without knowing torchrun.

Sets the same environment torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT), so the function simply calls `smp.init()`. A rank that raises or dies stops the
whole launch with that rank's error; the others are terminated rather than left waiting.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

_TERMINATE_GRACE_S = 5.0  # how long a terminated rank gets to exit before it is killed
# How long the queue is still read for a rank that exited 0 without its result having arrived: a
# result is flushed into the pipe before the rank exits, so this only covers a read just missed.
_RESULT_GRACE_S = 2.0


class LaunchError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def set_local_rank_env(rank: int, world: int, port: int) -> None:
    """The variables torchrun sets for rank `rank` of `world` ranks on this one host."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...], queue: Any) -> None:
    set_local_rank_env(rank, world, port)
    import torch

    # N ranks share this machine's cores; one intra-op thread each avoids oversubscription.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        result = fn(*args)
    except BaseException:
        queue.put((rank, "err", traceback.format_exc()))
        raise SystemExit(1) from None
    try:  # here, not in the queue's feeder thread, which drops a pickling error and exits 0 without a result
        payload = pickle.dumps(result)
    except Exception as exc:
        kind = type(result).__name__
        message = f"its return value ({kind}) cannot be pickled ({type(exc).__name__}: {exc}); return plain data"
        queue.put((rank, "err", message))
        raise SystemExit(1) from None
    queue.put((rank, "ok", payload))


def _check_exited(procs: list[Any], results: dict[int, Any], exited_at: dict[int, float]) -> None:
    """Raise for a rank that died, or that exited 0 and, reads later, has still sent no result
    (an os._exit(0) somewhere): otherwise the launch would wait out its whole timeout."""
    now = time.monotonic()
    for r, p in enumerate(procs):
        if r in results or p.exitcode is None:
            continue
        if p.exitcode != 0:
            raise LaunchError(f"rank {r} died with exit code {p.exitcode}")
        if now - exited_at.setdefault(r, now) >= _RESULT_GRACE_S:
            raise LaunchError(
                f"rank {r} exited (code 0) without returning a result; something ended its process "
                "early (os._exit?); let the function return on every rank"
            )


def launch_local(fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float = 3600.0) -> list[Any]:
    """Run `fn(*args)` on `nprocs` local ranks; return the per-rank results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, nprocs, port, args, queue)) for r in range(nprocs)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    exited_at: dict[int, float] = {}  # rank -> when it was first seen exited 0 with no result yet
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < nprocs:
            if time.monotonic() > deadline:
                raise LaunchError(f"ranks {sorted(set(range(nprocs)) - set(results))} did not finish in {timeout_s} s")
            try:
                rank, kind, value = queue.get(timeout=0.5)
            except Exception:
                _check_exited(procs, results, exited_at)
                continue
            if kind == "err":
                raise LaunchError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10 if len(results) == nprocs else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=_TERMINATE_GRACE_S)
            if p.is_alive():  # SIGTERM ignored or blocked (a handler, a stuck C call): no waiting forever
                p.kill()
                p.join(timeout=_TERMINATE_GRACE_S)
    return [results[r] for r in range(nprocs)]
