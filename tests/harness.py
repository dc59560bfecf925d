"""Run functions on N CPU ranks (gloo, one host) -- the real multi-process path of the test suite.

A `RankPool` spawns N processes once, joins them into a gloo process group on a free port, and then
runs many cases on them: `pool.run(fn, *args)` calls `fn(*args)` on every rank and returns the
per-rank results. Spawning (importing torch on 2 cores) costs seconds, so the suite keeps one pool
per world size alive (see conftest.py) and only replaces a pool after a failure.

Failures never hang the suite:
  * a rank that raises -> `RankFailure` with that rank's traceback;
  * a rank that dies   -> `RankFailure` naming the rank and its exit code;
  * a rank that hangs  -> after `timeout` seconds every live rank's Python stack is dumped (faulthandler),
                          the pool is killed and `RankFailure` carries the stacks.
Case functions must be importable (module top level); their results must be picklable. After every
case the worker calls `smp.shutdown()`, so each case starts from a clean facade, destroys the process
groups the case made itself, and collects garbage ([Note: pool worker resources]).

# [Note: pool worker resources]
# A worker serves hundreds of cases, and each case's smp.init() makes process groups. A gloo group
# owns 3 threads and a socket per peer until its Python object is freed -- destroy_process_group only
# unregisters it -- and a wrapped model is held in reference cycles (module <-> hooks) that only the
# cyclic collector frees, at some later collection. Left to that, the workers of a whole run held
# ~350 gloo contexts and ~1,000 threads each (issue 29 item 8). So after every case the worker
# destroys the groups still registered besides WORLD and runs gc.collect(): what the case made is
# gone before the next starts, and `worker_resources` can count what is left.

# [Note: forkserver ranks]
# Ranks used to start with "spawn": every process a fresh interpreter importing torch, shardpar and
# transformers -- ~25 s of CPU each on a loaded 2-core machine, paid again for every pool, every pool
# replaced after a failure, and every test that spawns ranks of its own. `process_context()` is a
# "forkserver" context whose server imports those modules once (the first time a rank is started);
# each rank is then a fork of it, started in well under a second. Forking after `import torch` is
# what DataLoader workers do: the server has run no intra-op parallel region and holds no process
# group. A rank still gets what spawn gave it -- the test process's environment *as of the pool's
# creation* (`inherited_env`, the server's own is from its start), its own sys.path/main module
# (multiprocessing's preparation data), and a fresh `random` state (re-seeded at fork by Python).
# What is read at import from the environment is read once, by the server, from the environment
# pytest started with; no pool's `env` is meant for that.
# One exception: a pool whose env sets glibc's MALLOC_* variables is for cases that measure their
# own RSS (memory_cases.py, frozen_cases.py); it still starts by spawn, so that its ranks' RSS is
# that of a process that loaded every page it maps itself, as when those bounds were set (a fork maps
# the server's shared libraries without counting them until touched again).
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from shardpar.cli.launcher import free_port, set_local_rank_env

DEFAULT_TIMEOUT_S = 120.0
_GRACE_AFTER_ERROR_S = 5.0
# Imported by the fork server (an ImportError is skipped by multiprocessing, so this is only a cache).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "shardpar",
    "transformers",
    "transformers.models.gpt_neox.modeling_gpt_neox",
    "transformers.models.gpt2.modeling_gpt2",
]


def process_context(method: str = "forkserver") -> Any:
    """The start method for every rank the tests start themselves ([Note: forkserver ranks])."""
    if method == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts, at the first rank started
    return ctx


def inherited_env() -> dict[str, str]:
    """The environment a spawned rank would have had: this process's, now."""
    return dict(os.environ)


def adopt_env(env: Mapping[str, str]) -> None:
    """In a forked rank: make `env` (from `inherited_env` in the parent) the whole environment."""
    os.environ.clear()
    os.environ.update(env)


class RankFailure(AssertionError):
    """One or more ranks raised, died or hung; the message holds every rank's story."""


def _worker(
    rank: int, world: int, port: int, conn: Connection, base_env: dict[str, str], env: dict[str, str], stack_file: str
) -> None:
    adopt_env(base_env)
    set_local_rank_env(rank, world, port)
    os.environ.update(env)
    with open(stack_file, "w") as stacks:  # stays open: faulthandler writes to it on SIGUSR1
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # N ranks share 2 cores: oversubscribed intra-op threads crawl
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
        conn.send(("ok", "ready"))
        while True:
            msg = conn.recv()
            if msg is None:
                break
            fn, args, kwargs = msg
            try:
                conn.send(("ok", fn(*args, **kwargs)))
            except BaseException:
                conn.send(("err", traceback.format_exc()))
            finally:
                _reset_case()
    # Told to stop, between cases: the last case's resources are already gone (_reset_case), so the
    # rank leaves at once. destroy_process_group and the interpreter's own teardown of torch took
    # seconds per rank on a loaded 2-core machine, and close() waited for them pool by pool.
    for child in mp.active_children():  # what a case started and left behind goes too, as at a normal exit
        child.terminate()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _reset_case() -> None:
    """What a case leaves behind goes before the next case ([Note: pool worker resources])."""
    import gc
    import sys

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    api = sys.modules.get("shardpar.api.context")
    if api is not None:
        api.shutdown()  # type: ignore[attr-defined]
    if dist.is_initialized():
        for pg in list(distributed_c10d._world.pg_map):
            if pg is not dist.group.WORLD:
                dist.destroy_process_group(pg)  # a group the case made with dist.new_group itself
    gc.collect()


def worker_resources() -> dict[str, int]:
    """This worker's OS threads and registered process groups (WORLD included): a case to run on a pool
    to check that serving cases leaves nothing behind."""
    from torch.distributed import distributed_c10d

    return {
        "threads": len(os.listdir("/proc/self/task")),
        "process_groups": len(distributed_c10d._world.pg_map),
    }


class RankPool:
    """N spawned ranks in one gloo world, reused across cases."""

    # start_timeout bounds a hang, not a budget: N ranks importing torch on a loaded 2-core machine took
    # over 120 s (issue 29 item 8).
    def __init__(self, world: int, *, env: Mapping[str, str] | None = None, start_timeout: float = 600.0) -> None:
        self.world = world
        self.env = dict(env or {})
        self._dir = tempfile.TemporaryDirectory(prefix=f"shardpar-pool{world}-")
        measures_rss = any(key.startswith("MALLOC_") for key in self.env)  # [Note: forkserver ranks]
        ctx = process_context("spawn" if measures_rss else "forkserver")
        port = free_port()
        env_of_ranks = inherited_env()
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(rank, world, port, child, env_of_ranks, self.env, self._stack_file(rank)),
                daemon=True,
                name=f"shardpar-rank{rank}",
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        replies = self._collect(time.monotonic() + start_timeout, "start-up")
        self._raise_if_failed(replies, "start-up")

    def _stack_file(self, rank: int) -> str:
        return str(Path(self._dir.name) / f"stacks{rank}.txt")

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """`fn(*args, **kwargs)` on every rank; the per-rank results, in rank order."""
        if not self.alive:
            raise RankFailure(f"pool of {self.world} ranks is no longer alive")
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        replies = self._collect(time.monotonic() + timeout, getattr(fn, "__name__", str(fn)))
        self._raise_if_failed(replies, getattr(fn, "__qualname__", str(fn)))
        return [value for _, value in replies]

    def _collect(self, deadline: float, what: str) -> list[tuple[str, Any]]:
        replies: dict[int, tuple[str, Any]] = {}
        while len(replies) < self.world:
            pending = [r for r in range(self.world) if r not in replies]
            waitables: list[Any] = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            ready = wait(waitables, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for r in pending:
                conn, proc = self._conns[r], self._procs[r]
                if conn in ready or proc.sentinel in ready:
                    replies[r] = self._reply_of(r, conn, proc)
                    if replies[r][0] != "ok":
                        # Peers of a failed rank usually block in a collective: don't wait for them long.
                        deadline = min(deadline, time.monotonic() + _GRACE_AFTER_ERROR_S)
        for r in range(self.world):
            if r not in replies:
                replies[r] = ("hung", self._dump_stack(r, what))
        return [replies[r] for r in range(self.world)]

    def _reply_of(self, rank: int, conn: Connection, proc: Any) -> tuple[str, Any]:
        try:
            if conn.poll():
                reply: tuple[str, Any] = conn.recv()
                return reply
        except (EOFError, OSError):
            pass
        proc.join(timeout=1.0)
        return ("died", f"rank {rank} died with exit code {proc.exitcode}")

    def _dump_stack(self, rank: int, what: str) -> str:
        proc = self._procs[rank]
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(0.5)
        stacks = Path(self._stack_file(rank)).read_text() if Path(self._stack_file(rank)).exists() else ""
        return f"rank {rank} did not finish {what!r} in time; its stacks:\n{stacks or '(none captured)'}"

    def _raise_if_failed(self, replies: list[tuple[str, Any]], what: str) -> None:
        failed = [(r, kind, value) for r, (kind, value) in enumerate(replies) if kind != "ok"]
        if not failed:
            return
        # A hung rank never reads the stop that close() sends (its stack is already in the message):
        # kill it now instead of after close()'s 5 s grace.
        for r, kind, _ in failed:
            if kind == "hung" and self._procs[r].is_alive():
                self._procs[r].kill()
        self.close()
        parts = [f"--- rank {r} ({kind}) ---\n{value}" for r, kind, value in failed]
        raise RankFailure(f"{what}: {len(failed)} of {self.world} ranks failed\n" + "\n".join(parts))

    def close(self) -> None:
        for conn, proc in zip(self._conns, self._procs, strict=True):
            if proc.is_alive():
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(None)
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._dir.cleanup()


class PoolCache:
    """One live pool per (world, env); a failed pool is replaced on next use."""

    def __init__(self) -> None:
        self._pools: dict[tuple[int, tuple[tuple[str, str], ...]], RankPool] = {}

    def get(self, world: int, env: Mapping[str, str] | None = None) -> RankPool:
        key = (world, tuple(sorted((env or {}).items())))
        pool = self._pools.get(key)
        if pool is None or not pool.alive:
            pool = self._pools[key] = RankPool(world, env=env)
        return pool

    def run(
        self,
        world: int,
        fn: Callable[..., Any],
        *args: Any,
        env: Mapping[str, str] | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        discard: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """`discard=True` closes the pool afterwards: for cases that leave the process group unusable
        (e.g. a collective that one rank deliberately skipped)."""
        pool = self.get(world, env)
        try:
            return pool.run(fn, *args, timeout=timeout, **kwargs)
        finally:
            if discard:
                pool.close()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
