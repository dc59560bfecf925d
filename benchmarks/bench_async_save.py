"""Training stall per checkpoint save, synchronous vs async_save=True (issue 32 item 1), and the staging memory.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_async_save.py [--world 4] [--sdp 2] [--saves 4] [--every 4]

A small GPT-NeoX on `world` CPU ranks (gloo). Per phase, on every rank:
  plain   `every` optimizer steps, no saving: the step time without checkpoints
  sync    a save every `every` steps; the stall is the save call's time (the whole write and commit)
  block   async_save=True with the staging copy inside the call (async_save.BLOCK_ON_STAGING, the
          behaviour before background staging): the stall is the call
  async   async_save=True, staging in the background ([Note: background staging]): the stall is the
          call plus what the next step's optimizer step waited for the copy ("waited")
In both async phases smp.poll_checkpoint() after every step commits the save once every writer is done,
so the steps in between pay the writer's competition and the poll.
The stall of a save is the slowest rank's (every rank waits for it at the next collective). Targets:
async stall <= 0.2 x sync stall, the steps between async saves <= 1.05 x plain steps. Staging memory is
this rank's host buffers (allocated by the first async save, reused by the next ones); the shard bytes
are its file's size.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("sync", "block", "async")


def _rank(
    world: int, sdp: int, saves: int, every: int, hidden: int, layers: int, vocab: int, root: str
) -> dict[str, Any]:
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    import shardpar as smp
    from shardpar.checkpoint import async_save

    torch.set_num_threads(1)
    smp.init({"sharded_data_parallel_degree": sdp, "sdp_param_persistence_threshold": 1000})  # layers sharded
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=4 * hidden, max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    model = smp.DistributedModel(GPTNeoXForCausalLM(cfg))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    gen = torch.Generator().manual_seed(smp.rdp_rank())

    def step() -> float:
        t0 = time.perf_counter()
        ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=gen)
        model.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    for _ in range(2):
        step()  # warm-up: first-touch allocations, the optimizer state
    # Rounds interleave the phases, so a load change on a shared machine hits them alike.
    out: dict[str, Any] = {"plain": [], **{m: {"stall": [], "between": [], "waited": []} for m in MODES}}
    for i in range(saves):
        out["plain"] += [step() for _ in range(every)]
        for mode in MODES[i % 3 :] + MODES[: i % 3]:  # each mode in each place of the round in turn
            async_save.BLOCK_ON_STAGING = mode == "block"
            smp.barrier()  # every rank enters the save together: the call's time is its own
            t0 = time.perf_counter()
            smp.save_checkpoint(f"{root}/{mode}", f"s{i}", model=model, num_kept_partial_checkpoints=2,
                                async_save=mode != "sync")  # fmt: skip
            out[mode]["stall"].append(time.perf_counter() - t0)
            waited0 = async_save.stage_wait_seconds()
            for _ in range(every):
                t = step()
                if mode != "sync":
                    t0 = time.perf_counter()
                    smp.poll_checkpoint()
                    t += time.perf_counter() - t0
                out[mode]["between"].append(t)
            out[mode]["waited"].append(async_save.stage_wait_seconds() - waited0)
            smp.wait_for_checkpoint()  # normally committed by a poll already; else not part of any phase
    async_save.BLOCK_ON_STAGING = False
    shard = Path(f"{root}/sync/s{saves - 1}_partial/shard-{smp.rank():05d}.safetensors")
    out["staging_bytes"] = async_save.staging_bytes()
    out["shard_bytes"] = shard.stat().st_size if shard.exists() else 0
    out["params"] = sum(p.numel() for p in GPTNeoXForCausalLM(cfg).parameters()) if smp.rank() == 0 else 0
    smp.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--sdp", type=int, default=2)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--every", type=int, default=4, help="steps between saves")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048, help="50304 with --hidden 768 --layers 12: the 168m class")
    p.add_argument("--dir", help="checkpoint directory (default: a temporary one, removed after)")
    a = p.parse_args()
    from shardpar.cli.launcher import launch_local

    root = a.dir or tempfile.mkdtemp(prefix="bench_async_save_")
    load = os.getloadavg()
    try:
        res = launch_local(
            _rank, a.world, a.world, a.sdp, a.saves, a.every, a.hidden, a.layers, a.vocab, root, timeout_s=1800
        )
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    mean = statistics.mean
    # a save's stall: the slowest rank's call; a step's time: the slowest rank's (they meet at collectives)
    plain = mean(max(r["plain"][i] for r in res) for i in range(len(res[0]["plain"])))
    print(f"GPT-NeoX {res[0]['params'] / 1e6:.1f} M parameters, world {a.world}, sdp {a.sdp}, {a.saves} saves")
    print(f"load average before {load[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    print(f"plain step                          {plain * 1e3:8.1f} ms")
    stall, median, cycle = {}, {}, {}
    for mode in MODES:
        # a save's stall: the slowest rank's call plus what its steps then waited for the staging copy
        each = [max(r[mode]["stall"][i] + r[mode]["waited"][i] for r in res) for i in range(a.saves)]
        waited = mean(max(r[mode]["waited"][i] for r in res) for i in range(a.saves))
        stall[mode] = mean(each)
        median[mode] = statistics.median(each)  # a loaded machine's outliers move the mean
        between = mean(max(r[mode]["between"][i] for r in res) for i in range(a.saves * a.every))
        print(
            f"{mode:5} stall per save {stall[mode] * 1e3:8.1f} ms (waited {waited * 1e3:6.1f})   steps between "
            f"saves {between * 1e3:8.1f} ms ({between / plain:.3f} x plain); each save "
            f"{', '.join(f'{t * 1e3:.0f}' for t in each)} ms"
        )
        # what checkpointing costs in all: the stall and the slower steps, against `every` plain steps
        cycle[mode] = stall[mode] + a.every * between
    plain_cycle = a.every * plain
    print(
        f"a save and {a.every} steps, over {a.every} plain steps: "
        + ", ".join(f"{m} {cycle[m] / plain_cycle:.3f}" for m in MODES)
    )
    for mode, what in (("block", "staging in the call"), ("async", "target <= 0.2")):
        print(
            f"{mode} / sync stall                  {stall[mode] / stall['sync']:.3f} of the means, "
            f"{median[mode] / median['sync']:.3f} of the medians ({what})"
        )
    for r, out in enumerate(res):
        staging, shard = out["staging_bytes"] / 2**20, out["shard_bytes"] / 2**20
        print(f"rank {r}: staging {staging:7.2f} MiB   its shard file {shard:7.2f} MiB")


if __name__ == "__main__":
    main()
