"""Bus bandwidth per engine x op x size x ranks (NCCL-tests conventions), and one training step per
`ddp_dist_backend`, all in one command so ratios are taken under the same machine noise.

    busbw = algbw * (n-1)/n        all_gather, reduce_scatter   (size = the large, gathered buffer)
    busbw = algbw * 2(n-1)/n       all_reduce
    algbw = size / time            time = median over 8 rounds of the slowest rank's mean over a loop
                                   of >= 0.1 s after the engine's own barrier; the engines alternate
                                   round by round, in reverse order every other round

    .venv/bin/python benchmarks/bench_collectives.py                       # 2 and 4 ranks, 4 KiB..64 MiB
    .venv/bin/python benchmarks/bench_collectives.py --ranks 2 --ops all_gather --max-mib 4
    .venv/bin/python benchmarks/bench_collectives.py --step-only

The physical bound is single-core memcpy bandwidth (one thread, 64 MiB buffers, from DRAM), measured at the
start and again at the end of the run -- it moves by 2x between runs on this shared VM -- and each
row at 16 MiB and up shows smddp's bus bandwidth as a share of the lower of the two. The copy floor is
the time for every rank to copy `size` bytes at once (the transport's own copy routine, non-temporal
stores), on the same ranks in the same run: an in-place
AllReduce must at least read and write its buffer once per rank, so it cannot beat that floor (an
AllGather writes `size` but reads only its shard from its own memory; a ReduceScatter reads `size` but
writes `size / n`: their floors are a little lower).

SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES (reference 003, default 16 MiB) sends an AllGather whose input is
larger than it to native. The bus-bandwidth table measures the transport, so the engine is built with a
scratch buffer as large as the largest input (`--ag-scratch-bytes` overrides); any call that still fell
back is marked in the table with its reason, so a native figure never passes for an smddp one. The
training step uses the knobs' defaults.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from tests.harness import RankPool

OPS = ("all_gather", "reduce_scatter", "all_reduce")
ENGINES = ("nccl", "smddp")  # "nccl" = the native torch.distributed engine (gloo on CPU)


def memcpy_gbps(nbytes: int = 64 << 20, rounds: int = 7) -> float:
    """Single-core copy bandwidth: torch's copy_ splits a 64 MiB copy over every intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _copy_gbps(nbytes, rounds)
    finally:
        torch.set_num_threads(threads)


def _copy_gbps(nbytes: int, rounds: int) -> float:
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


# Even, so that every call runs in each of its two positions equally often (see _time_interleaved).
ROUNDS = 8
# Each round loops a call at least this long, after a barrier of the engine being timed. Timed singly
# after a gloo barrier, a call also measured the ranks' skew leaving that barrier (up to several ms
# with 4 ranks on 2 cores), which only the fast engine notices.
ROUND_SECONDS = 0.1


class _Timed:
    """One `op` of `size` bytes on `engine` (None: the copy floor), on fixed buffers, and the barrier
    that lines the ranks up before it is timed (the engine's own, so its ranks leave it together)."""

    def __init__(self, engine, op: str, size: int, group) -> None:  # type: ignore[no-untyped-def]
        from shardpar.collectives import ReduceOp, shm

        n = group.size
        big = torch.randn(size // 4)
        small = torch.randn(size // 4 // n)
        other = torch.empty_like(big) if op == "copy" else big
        self.run = {
            "all_gather": lambda: engine.all_gather(big, small, group),
            "reduce_scatter": lambda: engine.reduce_scatter(small, big, group, op=ReduceOp.SUM),
            "all_reduce": lambda: engine.all_reduce(big, group),
            "copy": lambda: shm.stream_copy(other, big),  # the floor: every rank copies `size` bytes at once
        }[op]
        self.align = (lambda: dist.barrier()) if engine is None else (lambda: engine.barrier(group))


def _loop_seconds(call: _Timed, iters: int) -> float:
    """Mean seconds per call over `iters` back-to-back calls, the slowest rank's, after a barrier."""
    call.align()  # line the ranks up; not timed
    t0 = time.perf_counter()
    for _ in range(iters):
        call.run()
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _time_interleaved(calls: dict[str, _Timed]) -> dict[str, float]:
    """Median seconds per call for each named call, measured in alternating rounds so that the
    machine's drift (2x within minutes on this VM) hits every engine alike. Each round loops its call
    for about ROUND_SECONDS; every rank uses the slowest rank's first-call time, so all agree on
    the loop count. Every other round runs the calls in reverse order: in a fixed order the loop that
    ran right after gloo's was 1-30 % (median 15 %) slower than an identical one after it (A/A, 4 ranks,
    16-64 MiB AllReduce, docs/performance-history.md, "Reversed order every other round"), and that
    loop was always smddp's."""
    iters = {}
    for name, call in calls.items():
        first = torch.tensor([_loop_seconds(call, 1)], dtype=torch.float64)  # also the warm-up
        dist.all_reduce(first, op=dist.ReduceOp.MAX)
        iters[name] = max(1, min(200, int(ROUND_SECONDS / max(float(first), 1e-6))))
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls.items())
    for round_index in range(ROUNDS):
        for name, call in order if round_index % 2 == 0 else order[::-1]:
            times[name].append(_loop_seconds(call, iters[name]))
    return {name: statistics.median(t) for name, t in times.items()}


Row = tuple[str, str, int, float, str]  # engine, op, size, seconds, fallback reasons ("" = none)


def bench_rank(engines: list[str], ops: list[str], sizes: list[int], scratch: int) -> list[Row]:
    from shardpar.collectives import Group, make_engine

    group = Group("world", tuple(range(dist.get_world_size())), dist.group.WORLD)
    made = {name: make_engine(name, timeout_s=120, ag_scratch_bytes=scratch) for name in engines}
    rows = []
    for op in ops:
        for size in sizes:
            before = {name: Counter(getattr(e, "fallbacks", {})) for name, e in made.items()}
            seconds = _time_interleaved({name: _Timed(e, op, size, group) for name, e in made.items()})
            for name, engine in made.items():
                grew = sorted({why for _, why in Counter(getattr(engine, "fallbacks", {})) - before[name]})
                rows.append((name, op, size, seconds[name], ",".join(grew)))
    for engine in made.values():
        getattr(engine, "close", lambda: None)()
    floors = _time_interleaved({str(size): _Timed(None, "copy", size, group) for size in sizes})
    rows += [("floor", "copy", size, floors[str(size)], "") for size in sizes]
    return rows


def step_rank(backends: list[str], steps: int) -> dict[str, float]:
    """Median step time of a 8-block MLP (sdp 1: the balanced-fusion AllReduce path) per backend."""
    import shardpar as smp
    from tests.models import UnevenMLP, mlp_batch

    out: dict[str, list[float]] = {b: [] for b in backends}
    models = {}
    for b in backends:
        smp.init({"ddp_dist_backend": b, "sharded_data_parallel_degree": 1})
        torch.manual_seed(0)
        models[b] = smp.DistributedModel(UnevenMLP(width=13, hidden=4096, depth=8))
        opt = smp.DistributedOptimizer(torch.optim.AdamW(models[b].parameters(), lr=1e-3))
        batch = mlp_batch(0, 8)
        for s in range(steps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            models[b].backward(models[b](**batch))
            opt.step()
            opt.zero_grad()
            if s >= 2:
                out[b].append(time.perf_counter() - t0)
        smp.shutdown()
    return {b: statistics.median(v) for b, v in out.items()}


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--step-only", action="store_true")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ag-scratch-bytes", type=int, default=None, help="default: the largest AllGather input")
    args = ap.parse_args()
    start = memcpy_gbps()
    sizes = [4 << 10 << (2 * i) for i in range(8) if (4 << 10 << (2 * i)) <= args.max_mib << 20]
    tables, lines = [], []
    for world in [int(w) for w in args.ranks.split(",")]:
        pool = RankPool(world)
        try:
            if not args.step_only:
                scratch = args.ag_scratch_bytes or max(sizes) // world
                rows = pool.run(bench_rank, list(ENGINES), args.ops.split(","), sizes, scratch, timeout=1800)[0]
                tables.append((world, scratch, rows))
            steps = pool.run(step_rank, list(ENGINES), args.steps, timeout=900)[0]
            ratio = steps["nccl"] / steps["smddp"]
            lines.append(
                f"ranks {world} training step (8-block MLP, sdp 1): "
                + ", ".join(f"{b} {t * 1e3:.1f} ms" for b, t in steps.items())
                + f"; smddp is {ratio:.2f}x faster"
            )
        finally:
            pool.close()
    end = memcpy_gbps()
    print(f"single-core memcpy bandwidth (64 MiB): {start:.2f} GB/s at the start, {end:.2f} GB/s at the end")
    for world, scratch, rows in tables:
        print(f"\nranks {world} (SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES {scratch}): bus bandwidth GB/s (time)")
        _print_table(world, rows, min(start, end))
    print("\n" + "\n".join(lines))


def _print_table(world: int, rows: list[Row], memcpy: float) -> None:
    times = {(e, op, s): t for e, op, s, t, _ in rows}
    fell_back = {(e, op, s): why for e, op, s, _, why in rows if why}
    print("| op | size | gloo (nccl) | smddp | smddp / gloo | smddp / memcpy | smddp time / copy floor |")
    print("|---|---|---|---|---|---|---|")
    for (engine, op, size), t in times.items():
        if engine != "nccl":
            continue
        floor = times[("floor", "copy", size)]
        factor = (world - 1) / world * (2 if op == "all_reduce" else 1)
        bus = {e: size / times[(e, op, size)] / 1e9 * factor for e in ENGINES}
        ts = times[("smddp", op, size)]
        why = fell_back.get(("smddp", op, size))
        note = f" NATIVE FALLBACK ({why})" if why else ""
        print(
            f"| {op} | {_fmt_size(size)} | {bus['nccl']:.3f} ({t * 1e3:.2f} ms) | "
            f"{bus['smddp']:.3f} ({ts * 1e3:.3f} ms){note} | {bus['smddp'] / bus['nccl']:.1f}x | "
            + (f"{bus['smddp'] / memcpy:.0%} |" if size >= 16 << 20 else " |")
            + f" {ts / floor:.2f} |"
        )


if __name__ == "__main__":
    main()
