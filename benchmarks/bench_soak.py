"""Soak: does a rank's memory grow with the step count? (issue 24, item 5)

Trains a tiny model for many steps at world 4 (sdp 2: two replicas) and reads every rank's VmRSS and
VmHWM from /proc/self/status every `--every` steps. Growth is measured from the first sample after
`--warmup` steps (allocator and caches settled) to the last; the verdict is "flat" when no rank grew by
more than `--limit-mib`. Each engine runs in freshly spawned ranks; the ms/step column is the median
step time (forward + backward + step + zero_grad; the median of each sample's medians after the first), for
comparing two checkouts.

    .venv/bin/python benchmarks/bench_soak.py                          # 10,000 steps, both engines
    .venv/bin/python benchmarks/bench_soak.py --steps 3000 --every 500 --engines auto
    SOAK_SHARDPAR=/path/to/other/checkout .venv/bin/python benchmarks/bench_soak.py --clip 0   # A/B

Before the fix, CommStats.history kept every step's collective records: RSS grew ~3.1 KiB a step.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    values: dict[str, float] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


def _tiny_model() -> Any:
    """Three blocks in a ModuleList: four units (the blocks and the root), 17 collectives a step."""
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(16, 32)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
            self.head = nn.Linear(32, 4)

        def forward(self, x: Any) -> Any:
            h = self.inp(x)
            for block in self.blocks:
                h = block(h)
            return self.head(h)

    return Tiny()


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, engine: str, out: Any) -> None:
    sys.path.insert(0, os.environ.get("SOAK_SHARDPAR", REPO))
    from shardpar.cli.launcher import set_local_rank_env

    set_local_rank_env(rank, world, port)
    import torch
    from torch import nn

    import shardpar as smp

    torch.set_num_threads(1)
    knobs = {
        "sharded_data_parallel_degree": 2,
        "sdp_param_persistence_threshold": 10,
        "sdp_gradient_clipping": args.clip,
        "ddp_dist_backend": engine,
    }
    smp.init(knobs)
    torch.manual_seed(0)
    module = _tiny_model()
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(16)]
    samples: list[tuple[int, float, float]] = []
    traced = args.tracemalloc and rank == 0
    if traced:
        import tracemalloc

        tracemalloc.start(8)
    first: Any = None
    times: list[float] = []
    medians: list[float] = []  # of each sample's steps
    for step in range(1, args.steps + 1):
        x, y = data[step % len(data)]
        t0 = time.perf_counter()
        model.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        if step % args.every == 0:  # the step times are kept per sample: the soak itself must not grow
            samples.append((step, *_status()))
            medians.append(statistics.median(times))
            times.clear()
        if traced and step == args.warmup:
            first = tracemalloc.take_snapshot()
    if traced and first is not None:  # where Python-level memory grew after the warm-up, if it did
        for diff in tracemalloc.take_snapshot().compare_to(first, "traceback")[:5]:
            print(f"rank 0 tracemalloc: {diff}\n    " + "\n    ".join(diff.traceback.format()[-6:]), flush=True)
    stats = smp.comm_stats()
    kept = sum(len(s) for s in stats.history) + len(stats.current)
    smp.shutdown()
    out.put((rank, samples, statistics.median(medians[1:] or medians) * 1e3, kept))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_engine(args: argparse.Namespace, engine: str) -> dict[int, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, args.world, port, args, engine, out)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, samples, ms, kept = out.get(timeout=args.timeout)
        results[rank] = (samples, ms, kept)
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a rank exited with {p.exitcode}")
    return results


def report(engine: str, results: dict[int, Any], args: argparse.Namespace) -> bool:
    print(f"\nengine {engine}: {args.steps} steps, world {args.world}, sdp 2, clip {args.clip}")
    ranks = sorted(results)
    print("step    " + "  ".join(f"r{r} RSS/HWM MiB" for r in ranks))
    for i, (step, _, _) in enumerate(results[ranks[0]][0]):
        row = "  ".join(f"{results[r][0][i][1]:6.1f}/{results[r][0][i][2]:6.1f}" for r in ranks)
        print(f"{step:<7} {row}")
    flat = True
    for r in ranks:
        samples, ms, kept = results[r]
        base = next(s for s in samples if s[0] >= args.warmup)
        last = samples[-1]
        rss, hwm = last[1] - base[1], last[2] - base[2]
        per_step = rss * 1024 * 1024 / max(1, last[0] - base[0])
        flat &= rss <= args.limit_mib and hwm <= args.limit_mib
        print(
            f"rank {r}: RSS {base[1]:.1f} -> {last[1]:.1f} MiB ({rss:+.2f} MiB, {per_step:+.1f} B/step from step "
            f"{base[0]} to {last[0]}), HWM {hwm:+.2f} MiB; {ms:.2f} ms/step median; {kept} comm records kept"
        )
    print(f"engine {engine}: {'flat' if flat else 'GROWS'} (limit {args.limit_mib} MiB after step {args.warmup})")
    return flat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=1000, help="growth is measured from the first sample at/after it")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--engines", default="auto,nccl", help="auto (smddp where built) and/or nccl (native)")
    ap.add_argument("--clip", type=float, default=1.0, help="sdp_gradient_clipping")
    ap.add_argument("--limit-mib", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--tracemalloc", action="store_true", help="rank 0 prints where Python memory grew (slow)")
    args = ap.parse_args()
    if args.steps < args.warmup + args.every:
        raise SystemExit(f"--steps {args.steps} leaves no sample after --warmup {args.warmup} + --every {args.every}")
    ok = all([report(e, run_engine(args, e), args) for e in args.engines.split(",")])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
