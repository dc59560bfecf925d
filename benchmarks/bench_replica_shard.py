"""shard_optimizer_state on and off (issue 23): per-rank peak RSS and step time, side by side.

For each world size and each repeat, runs bench_memory.py's ranks (GPT-NeoX, AdamW, delayed
initialization, VmHWM per rank) with the knob off, then on, interleaved so that the machine's load
hits both alike; prints every rank's peak RSS, the median step time (steps after the first, which
allocates the optimizer state), and the on/off ratios of the per-run maxima over ranks.

    /work/main/.venv/bin/python -u benchmarks/bench_replica_shard.py --worlds 4,8 --sdp 2 --model small \\
        --persistence-threshold 1e4 --steps 4 --repeats 3 --mmap-threshold 1048576 [--precision bf16]

(--persistence-threshold 1e4: the small model's layer matrices, 262K elements, are sharded; at the
default 1e6 they would stay whole on every rank, and the knob splits only the sharded state.)

Results: docs/performance.md, "shard_optimizer_state".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import replace
from typing import Any

import bench_memory  # benchmarks/, on the path when run as a script


def _run(base: argparse.Namespace, world: int, on: bool) -> list[dict[str, Any]]:
    case = bench_memory.case_from(base, base.model, framework="shardpar", sdp=base.sdp)
    case = replace(case, world=world, shard_optimizer_state=on)
    return bench_memory.launch(case, bench_memory.REPO, base.timeout)


def _step_s(rank: dict[str, Any]) -> float:
    times = rank["steps_s"][1:] or rank["steps_s"]
    return float(statistics.median(times))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--worlds", default="4,8")
    ap.add_argument("--repeats", type=int, default=2)
    known, rest = ap.parse_known_args(argv)
    base = bench_memory.parse_args(rest)
    if base.mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(base.mmap_threshold)
    for world in [int(w) for w in known.worlds.split(",")]:
        sdp = base.sdp
        print(
            f"world {world}, sdp {sdp} x {world // sdp} replicas, GPT-NeoX {base.model}, {base.precision}, "
            f"batch {base.batch}x{base.seq}, {base.steps} steps, bucket {base.bucket:.3g}",
            flush=True,
        )
        maxima: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for rep in range(known.repeats):
            for on in (False, True):
                ranks = _run(base, world, on)
                hwm = [r["peak"] for r in ranks]
                steps = [_step_s(r) for r in ranks]
                maxima[on].append((max(hwm), max(steps)))
                rss, times = " ".join(f"{h:.0f}" for h in hwm), " ".join(f"{t:.3f}" for t in steps)
                label = "on " if on else "off"
                print(f"  repeat {rep} knob {label}: peak RSS per rank (MiB) {rss}; step time per rank (s) {times}")
        for name, pick in (("best", min), ("median", statistics.median)):
            got = {on: (pick(h for h, _ in m), pick(t for _, t in m)) for on, m in maxima.items()}
            (rss_off, t_off), (rss_on, t_on) = got[False], got[True]
            print(
                f"  {name} of {known.repeats}, max over ranks: off {rss_off:.0f} MiB {t_off:.3f} s; "
                f"on {rss_on:.0f} MiB {t_on:.3f} s; on/off: peak RSS {rss_on / rss_off:.3f}, "
                f"step time {t_on / t_off:.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
