"""Where an adapter-only save's time goes: bench_lora.py's PEFT GPT-NeoX under shardpar (4 ranks, sdp 4),
one training step, then --saves adapter-only partial saves, each phase timed on every rank.

    cd benchmarks && PYTHONPATH=.. ../.venv/bin/python profile_adapter_save.py --model 168m --saves 3

Phases are the package's own functions, wrapped with time.perf_counter in the rank process (inclusive
times: `collect` includes `fingerprint`, `commit` includes `rng file`, `index json`, `publish`,
`newest`); `gather wait` / `root wait` are the report all-gather and the broadcast of rank 0's result,
i.e. mostly waiting for the slowest rank; `prime at wrap` is the one-time hash of the frozen base when
the model is wrapped (repeated in every save's column, not part of a save). Printed: per phase, the
median over saves of the slowest rank's time and the median of each rank's, then DDP + PEFT's save
(rank 0: save_pretrained + optimizer.pt) of the same model for comparison, unless --no-ddp.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from dataclasses import replace
from typing import Any

from bench_lora import MODELS, Case, _setup  # benchmarks/, on the path when run as a script
from spawn_ranks import collect, free_port


def _instrument(spent: dict[str, float]) -> None:
    """Wrap the save's phases (module attributes the save path looks up at call time)."""
    from shardpar.checkpoint import atomic, fingerprint, partial, safetensors_io
    from shardpar.checkpoint import checksum as cs

    def wrap(owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t0

        setattr(owner, name, timed)

    try:  # the frozen base hashed once at wrap ([Note: fingerprint cache]), where this shardpar does
        from shardpar.api import wrappers

        wrap(wrappers, "prime_fingerprint", "prime at wrap (once per run)")
    except AttributeError:
        pass
    wrap(atomic, "make_tmp_dir", "prepare (sweep, mkdir, lock)")
    wrap(partial, "collect_rank_file", "collect (incl. fingerprint)")
    wrap(fingerprint, "rank_hashes", "  fingerprint (frozen shard CRC)")
    wrap(partial, "write_collected", "write rank file")
    wrap(safetensors_io.SafetensorsWriter, "close", "  file close (fsync + CRC wait)")
    wrap(cs.Background, "finish", "    CRC wait")
    wrap(atomic, "all_gather_object", "gather wait (reports)")
    wrap(atomic, "broadcast_object", "root wait (broadcast)")
    wrap(partial.SaveJob, "commit", "commit (rank 0)")
    wrap(partial, "write_tensors", "  rank 0 RNG file / rank files")
    wrap(partial.SaveJob, "build_index", "  build index")
    wrap(atomic, "write_json", "  index json")
    wrap(atomic, "publish_dir", "  publish (fsync dir, rename)")
    wrap(atomic, "write_text_atomic", "  newest pointer")
    wrap(partial, "prune", "  prune")
    wrap(os, "fsync", "(all fsyncs)")


def run_rank(case: Case, rank: int, saves: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    spent: dict[str, float] = defaultdict(float)
    if case.framework == "shardpar":
        _instrument(spent)
    step, _, save, teardown = _setup(case)
    once = {k: v for k, v in spent.items() if k.startswith("prime")}  # its own fingerprint time is no save's
    vocab = MODELS[case.model][4]
    ids = torch.randint(0, vocab, (case.batch, case.seq), generator=torch.Generator().manual_seed(rank))
    step({"input_ids": ids, "labels": ids})  # AdamW state exists
    out = []
    for i in range(saves):
        spent.clear()
        spent.update(once)
        dist.barrier()
        t0 = time.perf_counter()
        save(os.path.join(case.ckpt_dir, f"{case.framework}{i}"))
        spent["save (this rank)"] = time.perf_counter() - t0
        dist.barrier()
        spent["save (to barrier)"] = time.perf_counter() - t0
        out.append(dict(spent))
    teardown()
    return {"saves": out, "load": os.getloadavg()}


def _entry(case: Case, rank: int, port: int, queue: Any, saves: int) -> None:
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(case.world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(case.world),
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )  # fmt: skip
    try:
        queue.put((rank, "ok", run_rank(case, rank, saves)))
    except BaseException:
        queue.put((rank, "err", traceback.format_exc()))


def launch(case: Case, saves: int) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_entry, args=(case, r, port, queue, saves)) for r in range(case.world)]
    for p in procs:
        p.start()
    return collect(procs, queue, case.world, 1800)


def report(name: str, ranks: list[dict[str, Any]]) -> None:
    saves = len(ranks[0]["saves"])
    labels = list(dict.fromkeys(k for r in ranks for s in r["saves"] for k in s))
    print(f"\n{name}: {saves} saves, load average at the end {ranks[0]['load'][0]:.1f}")
    print("| phase | slowest rank (median of saves) | " + " | ".join(f"rank {r}" for r in range(len(ranks))) + " |")
    print("|---|---|" + "---|" * len(ranks))
    for label in labels:
        per_rank = [statistics.median(s.get(label, 0.0) for s in r["saves"]) for r in ranks]
        slowest = statistics.median(max(r["saves"][i].get(label, 0.0) for r in ranks) for i in range(saves))
        cells = " | ".join(f"{v * 1000:.0f}" for v in per_rank)
        print(f"| {label} | {slowest * 1000:.0f} ms | {cells} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="168m", choices=sorted(MODELS))
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--no-ddp", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="profile_save_") as tmp:
        for fw in ["shardpar"] + ([] if args.no_ddp else ["ddp"]):
            case = replace(Case(fw, args.model), ckpt_dir=tmp)
            t0 = time.perf_counter()
            ranks = launch(case, args.saves)
            print(f"{fw}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            report(fw, ranks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
