"""Bus bandwidth of the shared-memory transport vs torch.distributed gloo, in the same processes.

NCCL-tests conventions (size = the full buffer: AllGather output, ReduceScatter input, AllReduce tensor):
    allgather / reducescatter busbw = size * (n-1)/n / time        allreduce busbw = 2 * (n-1)/n * size / time
Each case: a few warm-up calls, then `--rounds` rounds of back-to-back calls (about 0.05 s each) after
a barrier; the per-call time is rank 0's median over rounds. Rounds alternate shm and gloo, so machine
noise (the machine is shared) hits both alike, and every other round runs them in reverse order.

    .venv/bin/python benchmarks/bench_shm.py                      # 2 and 4 ranks, 64K 1M 16M 64M, fp32
    .venv/bin/python benchmarks/bench_shm.py --ranks 2 --sizes 16M --dtype bfloat16 --chunk 2M
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from queue import Empty
from typing import Any

import torch
import torch.distributed as dist

OPS = ("allgather", "reducescatter", "allreduce")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def human(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def bus_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "allreduce" else (n - 1) / n


def make_calls(op: str, size: int, dtype: torch.dtype, n: int, comm: Any) -> dict[str, Callable[[], None]]:
    numel = size // torch.tensor([], dtype=dtype).element_size()
    full = torch.randn(numel).to(dtype)
    part = torch.empty(numel // n, dtype=dtype)
    if op == "allgather":
        inp = full[: numel // n].clone()
        return {"shm": lambda: comm.all_gather(full, inp), "gloo": lambda: dist.all_gather_single(full, inp)}
    if op == "reducescatter":
        return {
            "shm": lambda: comm.reduce_scatter(part, full),
            "gloo": lambda: dist.reduce_scatter_single(part, full),
        }
    full.zero_()  # summed in place over and over: zeros stay finite (no inf/NaN) for both backends
    return {"shm": lambda: comm.all_reduce(full), "gloo": lambda: dist.all_reduce(full)}


def time_case(calls: dict[str, Callable[[], None]], comm: Any, rounds: int) -> dict[str, float]:
    """Median seconds per call of each backend; rounds alternate backends so both see the same noise."""
    iters = {}
    for name, call in calls.items():
        for _ in range(2):
            call()
        comm.barrier()
        t0 = time.perf_counter()
        call()
        probe = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.broadcast(probe, src=0)  # every rank must run the same number of calls
        iters[name] = max(1, min(500, int(0.05 / max(float(probe), 1e-6))))
    per_call: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls.items())
    for round_index in range(rounds):  # reversed every other round: no call always runs right after gloo's
        for name, call in order if round_index % 2 == 0 else order[::-1]:
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(iters[name]):
                call()
            per_call[name].append((time.perf_counter() - t0) / iters[name])
    return {name: statistics.median(times) for name, times in per_call.items()}


def rank_main(rank: int, n: int, port: int, key: str, args: argparse.Namespace, queue: Any) -> None:
    from shardpar.collectives.shm import ShmComm

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=600))
    comm = ShmComm(key, "bench", rank, n, timeout_s=120.0, chunk_bytes=args.chunk)
    rows = []
    for op in args.ops:
        for size in args.sizes:
            calls = make_calls(op, size, DTYPES[args.dtype], n, comm)
            times = time_case(calls, comm, args.rounds)
            rows.append((op, size, times["shm"], times["gloo"]))
    comm.close()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(rows)


def run_world(n: int, args: argparse.Namespace) -> list[tuple[str, int, float, float]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = f"bench{os.getpid()}x{time.time_ns() % 10**9}"
    procs = [ctx.Process(target=rank_main, args=(r, n, port, key, args, queue)) for r in range(n)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 1800
    rows: list[tuple[str, int, float, float]] | None = None
    try:
        while rows is None:  # poll, so that a rank that died (bad flag, crash) ends the run at once
            try:
                rows = queue.get(timeout=0.5)
            except Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{n} ranks gave no result within 1800 s") from None
        return rows
    finally:
        for p in procs:
            p.join(timeout=60 if rows is not None else 0.5)  # after a result the ranks are only exiting
            if p.is_alive():
                p.terminate()
                p.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=["64K", "1M", "16M", "64M"])
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--chunk", type=parse_size, default="1M", help="shm staging chunk per rank (default 1M)")
    args = parser.parse_args()
    print(f"# {args.dtype}, chunk {human(args.chunk)}, median of {args.rounds} rounds; busbw in GB/s (1e9 B/s)")
    print(
        f"{'n':>2} {'op':<14} {'size':>5} {'shm us':>10} {'gloo us':>10} {'shm busbw':>10} {'gloo busbw':>10} {'x':>6}"
    )
    for n in args.ranks:
        for op, size, t_shm, t_gloo in run_world(n, args):
            bw = [size * bus_factor(op, n) / t / 1e9 for t in (t_shm, t_gloo)]
            print(
                f"{n:>2} {op:<14} {human(size):>5} {t_shm * 1e6:>10.1f} {t_gloo * 1e6:>10.1f} "
                f"{bw[0]:>10.2f} {bw[1]:>10.2f} {t_gloo / t_shm:>6.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
