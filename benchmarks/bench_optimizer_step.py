"""The optimizer's own cost, without sharding: `step()` alone over bench_step's model on one process and
one thread, with fixed random gradients, for AdamW, Muon (+AdamW for the rest) and Adafactor
(step_setups.make_optimizer). What owner compute ([Note: owner compute]) spreads over the owners.

    .venv/bin/python benchmarks/bench_optimizer_step.py --model 25m
"""

from __future__ import annotations

import argparse
import time

import step_setups as ss
import torch


def best_ms(opt: object, repeats: int) -> float:
    opts = opt if isinstance(opt, list) else [opt]
    for o in opts:
        o.step()  # state created outside the timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for o in opts:
            o.step()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="25m")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ss.build_model(args.model, 128)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    for kind in ("adamw", "muon", "adafactor"):
        ms = best_ms(ss.make_optimizer(kind, model), args.repeats)
        print(f"{kind:10s} step {ms:8.0f} ms (1 thread, best of {args.repeats})")


if __name__ == "__main__":
    main()
