"""Per-rank peak memory of shardpar training a Hugging Face GPT-NeoX, measured from outside (issue 19).

Spawns `--world` CPU ranks (gloo), each building the model under smp.delay_param_initialization (a
rank materialises only its shards, so building adds no full model), then training `--steps` steps
(AdamW, fp32 unless --precision, sdp = world unless --sdp, no activation checkpointing unless
--checkpointing; --shard-optimizer-state sets that knob). Each rank reports:

    hwm     the process's lifetime peak RSS (imports and build included): VmHWM before training,
            or the RSS before training plus the training peak, whichever is higher
    train   the peak RSS of the training steps minus the RSS before them (VmHWM reset through
            /proc/self/clear_refs), and the same split by phase -- forward, backward, optimizer
            step -- each the highest over the steps

--rev REV measures shardpar as of git revision REV instead of the checkout (git archive, the
checkout's built shm extension copied in), e.g. HEAD~1 for the code before a change.
--mmap-threshold BYTES sets MALLOC_MMAP_THRESHOLD_ for the ranks (glibc then returns every freed
block of that size or more to the OS at once, so RSS follows the tensors; without it, freed blocks
below its dynamic threshold -- up to 32 MiB -- stay in the heap and RSS keeps its high-water mark).

    /work/main/.venv/bin/python benchmarks/bench_memory.py                       # 168M, 4 ranks
    /work/main/.venv/bin/python benchmarks/bench_memory.py --rev HEAD~1 --mmap-threshold 1048576

Measured 2026-11-25 (2 shared cores, load ~12; 162.3M parameters, 4 ranks, sdp 4, fp32, batch 1x128,
2 steps, AdamW, --bucket 5e7 --mmap-threshold 1048576; max over ranks, MiB):

    revision                      VmHWM   training peak: forward / backward / optimizer
    e11fc33 (before issue 19)     1823.0  1122 / 1300 / 758
    a26ff8e (storage freed)       1755.4  1000 / 1232 / 765

Small here because the root unit (untied embed_in + embed_out: 77M of the 162M elements) stays
gathered through forward and backward, and native gloo's AllGather holds a flat temporary copy of
the root's whole output while gathering it (+309 MB), on top of AdamW's state from step 1: the
twelve layers (28 MB each) the old code kept alive are a small part of this model's peak.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

from spawn_ranks import collect, free_port  # benchmarks/, on the path when run as a script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS: dict[str, dict[str, int]] = {
    # 168M parameters (untied input and output embeddings: 2 x 50304 x 768 of them).
    "168m": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 1024},
}
VOCAB = 50304
PHASES = ("forward", "backward", "optimizer")


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(m.group(1)) / 1024 if m else float("nan")


def _rank(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    import shardpar as smp

    torch.set_num_threads(1)
    smp.init(
        {
            "sharded_data_parallel_degree": args.sdp or args.world,
            "sdp_reduce_bucket_size": args.bucket,
            "sdp_max_live_parameters": args.max_live,
            "ddp_dist_backend": args.backend,
            "shard_optimizer_state": args.shard_optimizer_state,
            "sdp_param_persistence_threshold": args.persistence_threshold,
            **({} if args.precision == "fp32" else {args.precision: True}),
        }
    )
    cfg = GPTNeoXConfig(vocab_size=VOCAB, max_position_embeddings=args.seq, use_cache=False, **MODELS[args.model])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with smp.delay_param_initialization():
        module = GPTNeoXForCausalLM(cfg)
    if args.checkpointing:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    numel = sum(p.numel() for p in module.parameters())
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(rank)
    build_hwm = _status_mib("VmHWM")  # the resets below lose it
    before = _status_mib("VmRSS")
    phases = dict.fromkeys(PHASES, 0.0)
    start = time.perf_counter()
    step_s = []
    for _ in range(args.steps):
        step_start = time.perf_counter()
        ids = torch.randint(0, VOCAB, (args.batch, args.seq), generator=g)
        _reset_hwm()
        loss = model(input_ids=ids, labels=ids).loss
        phases["forward"] = max(phases["forward"], _status_mib("VmHWM") - before)
        _reset_hwm()
        model.backward(loss)
        del loss
        phases["backward"] = max(phases["backward"], _status_mib("VmHWM") - before)
        _reset_hwm()
        opt.step()
        opt.zero_grad()
        phases["optimizer"] = max(phases["optimizer"], _status_mib("VmHWM") - before)
        step_s.append(time.perf_counter() - step_start)
    seconds = time.perf_counter() - start
    smp.shutdown()
    train = max(phases.values())
    hwm = max(build_hwm, before + train)
    return {"numel": numel, "hwm": hwm, "train": train, "before": before, "s": seconds, "step_s": step_s, **phases}


def _reset_hwm() -> None:
    """VmHWM := the current RSS (Linux >= 4.0), so the next read is the peak since now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _entry(args: argparse.Namespace, path: str, rank: int, port: int, queue: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(args.world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(args.world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    sys.path.insert(0, path)
    try:
        queue.put((rank, "ok", _rank(args, rank)))
    except BaseException:
        queue.put((rank, "err", traceback.format_exc()))
        raise SystemExit(1) from None


def launch(args: argparse.Namespace, path: str) -> list[dict[str, Any]]:
    if args.mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)  # inherited by the spawned ranks
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(args, path, r, port, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    return collect(procs, queue, args.world, args.timeout)


def snapshot(rev: str | None) -> tuple[str, str]:
    """(label, folder holding a shardpar package): the checkout, or REV's shardpar with the checkout's
    built extension (the shm transport's C side must not differ between the two)."""
    if rev is None:
        return "checkout", REPO
    git = ["git", "-C", REPO]
    short = subprocess.run([*git, "rev-parse", "--short", rev], capture_output=True, text=True, check=True)
    dst = tempfile.mkdtemp(prefix="bench_memory_")
    archive = subprocess.run([*git, "archive", rev, "shardpar"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", dst], input=archive.stdout, check=True)
    for name in os.listdir(os.path.join(REPO, "shardpar")):
        if name.startswith("_shm") and name.endswith(".so"):
            shutil.copy2(os.path.join(REPO, "shardpar", name), os.path.join(dst, "shardpar"))
    return f"shardpar@{short.stdout.strip()}", dst


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="168m")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--sdp", type=int, default=0, help="sharded_data_parallel_degree (default: the world)")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    ap.add_argument("--shard-optimizer-state", action="store_true", help="the shard_optimizer_state knob")
    ap.add_argument(
        "--persistence-threshold", type=float, default=1e6, help="sdp_param_persistence_threshold (elements)"
    )
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--bucket", type=float, default=5e8, help="sdp_reduce_bucket_size (elements)")
    ap.add_argument("--max-live", type=float, default=1e9, help="sdp_max_live_parameters (elements)")
    ap.add_argument("--backend", default="auto", help="ddp_dist_backend")
    ap.add_argument("--checkpointing", action="store_true", help="HF gradient checkpointing (non-reentrant)")
    ap.add_argument("--mmap-threshold", type=int, default=0, help="MALLOC_MMAP_THRESHOLD_ for the ranks (bytes)")
    ap.add_argument("--rev", default=None, help="git revision of shardpar to measure instead of the checkout")
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    args.bucket, args.max_live = int(args.bucket), int(args.max_live)
    args.persistence_threshold = int(args.persistence_threshold)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    label, path = snapshot(args.rev)
    try:
        ranks = launch(args, path)
    finally:
        if path != REPO:
            shutil.rmtree(path, ignore_errors=True)
    print(
        f"{label}: GPT-NeoX {args.model} ({ranks[0]['numel'] / 1e6:.1f}M parameters), {args.world} ranks, "
        f"sdp {args.sdp or args.world}, {args.precision}, shard_optimizer_state {args.shard_optimizer_state}, "
        f"batch {args.batch}x{args.seq}, {args.steps} steps, bucket {args.bucket:.3g}, "
        f"max_live {args.max_live:.3g}, checkpointing {args.checkpointing}, "
        f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold or 'unset'}"
    )
    for r, res in enumerate(ranks):
        split = " / ".join(f"{res[k]:.0f}" for k in PHASES)
        print(
            f"  rank {r}: peak RSS (VmHWM) {res['hwm']:7.1f} MiB   training peak above the pre-step RSS "
            f"{res['train']:7.1f} MiB (forward / backward / optimizer {split})   "
            f"(pre-step RSS {res['before']:.1f} MiB, {res['s']:.1f} s)"
        )
    hwm, train = max(r["hwm"] for r in ranks), max(r["train"] for r in ranks)
    split = " / ".join(f"{max(r[k] for r in ranks):.0f}" for k in PHASES)
    print(f"  max over ranks: VmHWM {hwm:.1f} MiB, training {train:.1f} MiB (forward / backward / optimizer {split})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
