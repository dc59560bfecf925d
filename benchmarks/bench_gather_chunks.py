"""A/B: the native engine's chunked AllGather (collectives/native._gather_in_chunks) of a 160 MB fp32
output at 4 gloo ranks, chunks of 4 MiB against 32 MiB, interleaved; rank 0 prints (min, median) seconds.

Run: PYTHONPATH=. .venv/bin/python benchmarks/bench_gather_chunks.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4


class _WorldGroup:
    """What _gather_in_chunks reads of a Group: its size, and the default process group as handle."""

    def __init__(self, n: int) -> None:
        self.size, self.handle = n, None


def worker(rank: int, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29871")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from shardpar.collectives import native

    numel = 40 * 2**20 // world
    x = torch.full((numel,), float(rank))
    y = torch.empty(numel * world)
    times: dict[int, list[float]] = {4: [], 32: []}
    for rep in range(5):
        for mib in (4, 32) if rep % 2 == 0 else (32, 4):
            native.GLOO_GATHER_CHUNK_BYTES = mib << 20
            dist.barrier()
            t = time.perf_counter()
            native._gather_in_chunks(y, x, _WorldGroup(world)).wait()  # type: ignore[arg-type]
            dist.barrier()
            times[mib].append(time.perf_counter() - t)
    if rank == 0:
        summary: dict[int, Any] = {k: (round(min(v), 3), round(statistics.median(v), 3)) for k, v in times.items()}
        print(summary, flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no gloo teardown: it can hang at exit with async works retired


if __name__ == "__main__":
    mp.spawn(worker, args=(WORLD,), nprocs=WORLD)
