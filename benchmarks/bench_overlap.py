"""Does prefetch overlap communication with computation? One command, side by side in one run:

    .venv/bin/python benchmarks/bench_overlap.py [--world 2] [--steps 12] [--hidden 256] [--layers 4]

For prefetch depth 0 (gather on demand) and 1 (gather the next unit while this one computes) it
reports the median step time and the time the hooks spent *blocked* waiting for AllGathers
(`Unit.wait_for_unshard`). With overlap, the blocked time drops even where the step time cannot
(2 cores shared by compute and gloo's communication thread).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch


def _rank(depth: int, steps: int, hidden: int, layers: int) -> dict[str, Any]:
    import transformers
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    import shardpar as smp
    from shardpar import unit as unit_mod

    transformers.logging.set_verbosity_error()
    blocked = [0.0]
    original = unit_mod.Unit.wait_for_unshard

    def timed(self: Any) -> None:
        start = time.perf_counter()
        original(self)
        blocked[0] += time.perf_counter() - start

    unit_mod.Unit.wait_for_unshard = timed  # type: ignore[method-assign]
    import os

    smp.init({"sharded_data_parallel_degree": int(os.environ["WORLD_SIZE"]), "sdp_param_persistence_threshold": 1000})
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(
        vocab_size=1024,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=4 * hidden,
        max_position_embeddings=128,
    )
    model = smp.DistributedModel(GPTNeoXForCausalLM(cfg))
    model.set_prefetch_depth(depth)
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
    unit_mod.Unit.wait_for_unshard = original  # type: ignore[method-assign]
    return {"step_ms": statistics.median(times) * 1e3, "blocked_ms": statistics.median(waits) * 1e3}


def main() -> None:
    from shardpar.launcher import launch_local

    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    rows = {}
    for depth in (0, 1, 0, 1):  # interleaved: the machine is shared and noisy
        res = launch_local(_rank, args.world, depth, args.steps, args.hidden, args.layers)
        rows.setdefault(depth, []).append(res[0])
    print(f"world {args.world}, GPT-NeoX hidden {args.hidden} x {args.layers} layers, batch 4x128 per rank")
    print("prefetch depth | median step ms | median ms blocked on AllGather per step")
    for depth, results in rows.items():
        step = statistics.median(r["step_ms"] for r in results)
        blocked = statistics.median(r["blocked_ms"] for r in results)
        print(f"{depth:14d} | {step:14.1f} | {blocked:10.1f}")


if __name__ == "__main__":
    main()
