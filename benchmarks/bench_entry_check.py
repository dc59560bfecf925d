"""What the check-in before a gathering call costs ([Note: collective entry], collectives/entry.py).

Spawns --world gloo ranks on this host. Each times --calls `smp.barrier()` (a world barrier: the
cheapest checked call, so the check-in's share is largest) with the check-in and without it
(`state().entry = None`), alternating round by round, and one `model.state_dict()` of a tiny GPT-NeoX
at sdp 2 each way. Medians over --rounds; per call, in ms. Compare within one run (a loaded machine
stretches both).

    .venv/bin/python benchmarks/bench_entry_check.py --world 4 --calls 50 --rounds 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

from benchmarks.spawn_ranks import collect, free_port


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    try:
        from shardpar.cli.launcher import set_local_rank_env

        set_local_rank_env(rank, world, port)
        import torch

        torch.set_num_threads(1)
        import shardpar as smp
        from shardpar.api.context import state
        from tests import models

        smp.init({"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0})
        model = smp.DistributedModel(models.tiny_neox())
        entry = state().entry
        times: dict[str, list[float]] = {"barrier on": [], "barrier off": [], "state_dict on": [], "state_dict off": []}
        for _ in range(args.rounds):
            for mode in ("on", "off"):
                state().entry = entry if mode == "on" else None
                model._entry = state().entry
                smp.barrier()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    smp.barrier()
                times[f"barrier {mode}"].append((time.perf_counter() - t0) / args.calls * 1e3)
                t0 = time.perf_counter()
                model.state_dict()
                times[f"state_dict {mode}"].append((time.perf_counter() - t0) * 1e3)
        smp.shutdown()
        queue.put((rank, "ok", {k: statistics.median(v) for k, v in times.items()}))
    except BaseException:
        import traceback

        queue.put((rank, "err", traceback.format_exc()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = collect(procs, queue, args.world, timeout_s=600)
    r0 = results[0]
    for what in ("barrier", "state_dict"):
        on, off = r0[f"{what} on"], r0[f"{what} off"]
        print(f"{what:10s} with check-in {on:8.3f} ms  without {off:8.3f} ms  ratio {on / off:5.2f}  (rank 0 medians)")


if __name__ == "__main__":
    main()
