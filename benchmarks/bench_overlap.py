"""Does communication overlap computation? One command, side by side in one run (interleaved A/B):

    .venv/bin/python benchmarks/bench_overlap.py [--world 2] [--steps 12] [--hidden 256] [--layers 4]
    .venv/bin/python benchmarks/bench_overlap.py --mode replication [--world 2] [--hidden 512]

`--mode prefetch` (sdp = world): prefetch depth 0 (gather on demand) against 1 (gather the next unit
while this one computes); "blocked" = time the hooks waited for AllGathers (`Unit.wait_for_unshard`).

`--mode replication` (sdp 1, plain data parallelism, one bucket per unit, i.e. per block): the bucket's
replication AllReduce issued as the bucket closes, during backward ([Note: replication in the bucket]),
against the per-unit AllReduce after backward; "blocked" = time spent at the end of backward
(`ModelHooks._finish_backward` in runtime/hooks.py: waiting for the buckets, the AllReduces not yet done).

With overlap, the blocked time drops even where the step time cannot (2 cores shared by compute and
the engine's communication thread).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def _timed(owner: Any, name: str, blocked: list[float]) -> Callable[[], None]:
    """Wrap owner.name to add its wall time to blocked[0]; returns the undo."""
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            blocked[0] += time.perf_counter() - start

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, original)


def _neox(hidden: int, layers: int) -> torch.nn.Module:
    import transformers
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(
        vocab_size=1024,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=4 * hidden,
        max_position_embeddings=128,
    )
    return GPTNeoXForCausalLM(cfg)


def _rank(mode: str, variant: int, steps: int, hidden: int, layers: int) -> dict[str, Any]:
    import shardpar as smp
    from shardpar.runtime import hooks as hooks_mod
    from shardpar.runtime import unit as unit_mod

    blocked = [0.0]
    world = int(os.environ["WORLD_SIZE"])
    knobs: dict[str, Any] = {"sdp_param_persistence_threshold": 1000}
    if mode == "prefetch":
        knobs["sharded_data_parallel_degree"] = world
        undo = _timed(unit_mod.Unit, "wait_for_unshard", blocked)
    else:
        knobs.update(sharded_data_parallel_degree=1, sdp_reduce_bucket_size=1)  # a bucket per unit
        undo = _timed(hooks_mod.ModelHooks, "_finish_backward", blocked)
    smp.init(knobs)
    model = smp.DistributedModel(_neox(hidden, layers))
    if mode == "prefetch":
        model.set_prefetch_depth(variant)
    elif not variant:  # the AllReduce per unit after backward, as before the bucket carried it
        begin = model.reducer.begin_backward
        model.reducer.begin_backward = lambda *, boundary, scale: begin(boundary=False, scale=scale)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    ids = torch.randint(0, 1024, (4, 128), generator=torch.Generator().manual_seed(smp.rank()))
    times, waits = [], []
    for step in range(steps):
        blocked[0] = 0.0
        start = time.perf_counter()
        model.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
        if step >= 2:  # warm-up: the first step records the unit order
            times.append(time.perf_counter() - start)
            waits.append(blocked[0])
    undo()
    return {"step_ms": statistics.median(times) * 1e3, "blocked_ms": statistics.median(waits) * 1e3}


def main() -> None:
    from shardpar.cli.launcher import launch_local

    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("prefetch", "replication"), default="prefetch")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rows: dict[int, list[dict[str, Any]]] = {}
    for _ in range(args.repeats):
        for variant in (0, 1):  # interleaved: the machine is shared and noisy
            res = launch_local(_rank, args.world, args.mode, variant, args.steps, args.hidden, args.layers)
            rows.setdefault(variant, []).append(res[0])
    print(f"world {args.world}, GPT-NeoX hidden {args.hidden} x {args.layers} layers, batch 4x128 per rank")
    if args.mode == "prefetch":
        print("prefetch depth | median step ms | median ms blocked on AllGather per step")
    else:
        print("AllReduce in the bucket | median step ms | median ms at the end of backward per step")
    for variant, results in rows.items():
        step = statistics.median(r["step_ms"] for r in results)
        blocked = statistics.median(r["blocked_ms"] for r in results)
        print(f"{variant:14d} | {step:14.1f} | {blocked:10.1f}")


if __name__ == "__main__":
    main()
