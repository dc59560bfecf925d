"""Per-rank peak memory of training a Hugging Face GPT-NeoX, measured from outside (issue 19): shardpar,
torch FSDP2 and DDP, beside `shardpar estimate`'s figure and the analytical floor.

Each run spawns `--world` CPU ranks (gloo) that build the model and train `--steps` steps (AdamW,
fp32 unless --precision, batch x seq random tokens); memory_ranks.py says how each framework is built. Per rank, from
/proc/self/status (MiB): `baseline` (RSS before the model exists), `build` (VmHWM at the end of
building model and optimizer), the VmHWM of each phase (reset through /proc/self/clear_refs),
`states` (RSS at the end of a backward: model states and their gradients) and `peak` (the lifetime
VmHWM). Beside them, from shardpar/cli/estimate.py: `estimate` (the estimator's per-rank peak for
this run, its framework term replaced by the measured baseline) and `floor` (issue 19's analytical
floor, `estimate.floor`: the baseline + every model state at full size + the largest gathered set +
one reduce bucket + all activations).

    # one run: shardpar, 162M, 4 ranks, sdp 4 (--rev REV: shardpar as of a git revision)
    .venv/bin/python benchmarks/bench_memory.py --model 168m --sdp 4 --bucket 5e7 --mmap-threshold 1048576
    # the same for FSDP2 / DDP (DDP: sdp 1, --world 4)
    .venv/bin/python benchmarks/bench_memory.py --model 168m --sdp 4 --framework fsdp2 --mmap-threshold 1048576
    # the estimator's calibration table, sizes x sdp 1/2/4 and single changes
    .venv/bin/python benchmarks/bench_memory.py --calibrate --bucket 5e7 --mmap-threshold 1048576 \\
        --out tests/unit/measured_memory.json
    # capacity within 20 GiB at 4 ranks: a few depths of a family, a line, the largest depth within
    # (--reuse FILES takes runs already measured; --confirm runs the predicted size if memory allows)
    .venv/bin/python benchmarks/bench_memory.py --capacity shardpar --layers 4,8,12 --bucket 5e7 \\
        --mmap-threshold 1048576

--mmap-threshold BYTES sets MALLOC_MMAP_THRESHOLD_ for every rank of every framework: glibc then serves
each block of that size or more from mmap and returns it to the OS when freed, so RSS follows the
live tensors. Unset, glibc's dynamic threshold rises to 32 MiB as big blocks are freed, and freed
blocks below it stay in the heap, fragmented: RSS then keeps a high-water mark of its own (shardpar
+11 to +32 % at 162M, FSDP2 +87 %: docs/performance.md). --rev REV measures shardpar as of git
revision REV. Results: docs/performance.md, "Memory".
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, replace
from typing import Any

from spawn_ranks import collect, free_port  # benchmarks/, on the path when run as a script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1024.0  # MiB
# name -> (hidden, layers, heads, intermediate, vocab); all GPT-NeoX with untied embeddings
MODELS: dict[str, tuple[int, int, int, int, int]] = {
    "small": (256, 4, 4, 1024, 50304),  # 29.0M, most of it the embeddings (bench_replica_shard.py)
    "25m": (512, 8, 8, 2048, 1024),  # 26.3M: bench_step's 25m (embeddings below the persistence threshold)
    "168m": (768, 12, 12, 3072, 50304),  # 162.3M, 77M of it the two embeddings
    "563m": (1024, 36, 16, 4096, 50304),  # 556.5M
    "neox2048": (2048, 16, 16, 8192, 50304),  # Pythia-1B's shape; --layers picks the depth (16: 1.01B)
    "neox1024": (1024, 24, 16, 4096, 50304),  # Pythia-410M's shape; DDP's capacity family
}
# The estimator's calibration runs (tests/unit/measured_memory.json): every size at sdp 1, 2 and 4 with
# the command's knobs, then single changes: the default reduce bucket (5e8), activation checkpointing,
# a batch whose activations count (4 x 256).
CALIBRATION: list[tuple[str, int, dict[str, Any]]] = [
    *((model, sdp, {}) for model in ("25m", "168m", "563m") for sdp in (1, 2, 4)),
    ("168m", 4, {"bucket": int(5e8)}),
    ("168m", 4, {"checkpointing": True}),
    ("25m", 2, {"batch": 4, "seq": 256}),
    ("25m", 2, {"batch": 4, "seq": 256, "checkpointing": True}),
]
BUDGET_MIB = 20 * GIB  # the capacity benchmark's total over 4 ranks
SPARE_MIB = 3 * GIB  # a run starts only if the machine keeps this much available beside it (shared)
CAPACITY_FRAMEWORKS = {  # label -> (framework, sdp, checkpointing, model family)
    "shardpar": ("shardpar", 4, False, "neox2048"),
    "shardpar-ckpt": ("shardpar", 4, True, "neox2048"),
    "fsdp2": ("fsdp2", 4, False, "neox2048"),
    # A rank of DDP holds the whole model: the 2048-wide family's smallest member (1 layer, 256M) is
    # already above 20 GiB at 4 ranks, so DDP is measured on the 1024-wide one.
    "ddp": ("ddp", 1, False, "neox1024"),
}


def _entry(case: Any, path: str, rank: int, port: int, queue: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(case.world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(case.world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    sys.path.insert(0, path)
    try:
        from memory_ranks import run_rank

        queue.put((rank, "ok", run_rank(case, rank)))
    except BaseException:
        queue.put((rank, "err", traceback.format_exc()))
        raise SystemExit(1) from None


def launch(case: Any, path: str, timeout: float) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(case, path, r, port, queue)) for r in range(case.world)]
    for p in procs:
        p.start()
    return collect(procs, queue, case.world, timeout)


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


def predicted(case: Any, baseline_mib: float) -> dict[str, float]:
    """The estimator's peak and the analytical floor for `case` (MiB), with the measured baseline as
    the framework term. The shape is arithmetic (shape_from_dims): the parent builds no model; what it
    imports (shardpar, hence torch) does not reach the ranks, which are spawned fresh."""
    sys.path.insert(0, REPO)
    from shardpar.cli import estimate as est

    shape = est.shape_from_dims(
        case.hidden, case.layers, vocab=case.vocab, num_heads=case.heads, persistence_threshold=case.persistence
    )
    setup = est.Setup(
        sdp=case.sdp,
        batch=case.batch,
        seq=case.seq,
        precision=case.precision,
        shard_optimizer_state=case.shard_optimizer_state,
        world=case.world,
        activation_checkpointing=case.checkpointing,
        reduce_bucket_size=case.bucket,
        max_live_parameters=case.max_live,
        device="cpu",
        framework_bytes=int(baseline_mib * 2**20),
    )
    e = est.estimate(shape, setup)
    return {"estimate": e.total / 2**20, "floor": est.floor(shape, setup) / 2**20}


def run(case: Any, args: argparse.Namespace, path: str = REPO, label: str = "checkout") -> dict[str, Any]:
    """One measured run: per-rank results, their maxima and sums, the estimate and the floor."""
    started = time.strftime("%Y-%m-%d %H:%M")
    ranks = launch(case, path, args.timeout)
    keys = ("baseline", "build", "forward", "backward", "optimizer", "states", "peak")
    worst = {k: max(r[k] for r in ranks) for k in keys}
    row: dict[str, Any] = {
        "label": label,
        "case": asdict(case),
        "numel": ranks[0]["numel"],
        "mmap_threshold": args.mmap_threshold or None,
        "started": started,
        "ranks": ranks,
        "max": worst,
        "total_peak": sum(r["peak"] for r in ranks),
        "step_s": max(r["step_s"] for r in ranks),
    }
    if case.framework == "shardpar":
        row.update(predicted(case, worst["baseline"]))
    return row


def report(row: dict[str, Any]) -> None:
    c = row["case"]
    print(
        f"{row['label']} {c['framework']}: GPT-NeoX {c['hidden']}x{c['layers']} vocab {c['vocab']} "
        f"({row['numel'] / 1e6:.1f}M parameters), {c['world']} ranks, sdp {c['sdp']}, {c['precision']}, batch "
        f"{c['batch']}x{c['seq']}, {c['steps']} steps, bucket {c['bucket']:.3g}, checkpointing {c['checkpointing']}, "
        f"MALLOC_MMAP_THRESHOLD_={row['mmap_threshold'] or 'unset'}"
    )
    for i, r in enumerate(row["ranks"]):
        print(
            f"  rank {i}: peak {r['peak']:7.1f}  baseline {r['baseline']:6.1f}  build {r['build']:7.1f}  "
            f"forward / backward / optimizer {r['forward']:.0f} / {r['backward']:.0f} / {r['optimizer']:.0f}  "
            f"states {r['states']:.0f}  step {r['step_s']:.1f} s"
        )
    m = row["max"]
    line = (
        f"  max over ranks: peak {m['peak']:.1f} MiB, build {m['build']:.1f}; "
        f"sum of peaks {row['total_peak'] / GIB:.2f} GiB"
    )
    if "estimate" in row:
        line += (
            f"; estimate {row['estimate']:.1f} ({row['estimate'] / m['peak'] - 1:+.1%}), floor {row['floor']:.1f} "
            f"(peak / floor {m['peak'] / row['floor']:.2f})"
        )
    print(line, flush=True)


def case_from(args: argparse.Namespace, model: str, *, framework: str, sdp: int, layers: int | None = None) -> Any:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from memory_ranks import MemCase

    hidden, depth, heads, inter, vocab = MODELS[model]
    world = args.world or max(sdp, 1)
    if framework != "shardpar":  # shardpar's knobs mean nothing to the others: their defaults, so runs match
        return MemCase(
            framework=framework, hidden=hidden, layers=layers or depth, heads=heads, intermediate=inter,
            vocab=vocab, world=world, sdp=sdp, batch=args.batch, seq=args.seq, steps=args.steps,
            checkpointing=args.checkpointing,
        )  # fmt: skip
    return MemCase(
        framework=framework, hidden=hidden, layers=layers or depth, heads=heads, intermediate=inter, vocab=vocab,
        world=world, sdp=sdp, batch=args.batch, seq=args.seq, steps=args.steps, bucket=int(args.bucket),
        max_live=int(args.max_live), checkpointing=args.checkpointing, backend=args.backend,
        persistence=int(args.persistence_threshold), precision=args.precision,
        shard_optimizer_state=args.shard_optimizer_state,
    )  # fmt: skip


def calibrate(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The estimator's calibration matrix: each size at sdp 1, 2, 4, each at world = sdp (a rank's memory
    depends on sdp, not on the replicas beside its sharding group)."""
    rows = []
    for model, sdp, changes in CALIBRATION:
        row = run(replace(case_from(args, model, framework="shardpar", sdp=sdp), **changes), args)
        report(row)
        rows.append(row)
    return rows


def mem_available_mib() -> float:
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return kib / 1024


def capacity(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Sum over 4 ranks of the lifetime peak at a few depths of a model family (run now, or read
    from --reuse files), a straight line through the two deepest, and the deepest model the line puts
    within BUDGET_MIB. --confirm then runs that model, if the machine has its memory and SPARE_MIB free."""
    rows = []
    depths = [int(x) for x in args.layers.split(",")]
    old = []
    for path in args.reuse.split(",") if args.reuse else []:
        with open(path) as f:
            old += json.load(f)["rows"]
    threshold = args.mmap_threshold or None
    for label in args.capacity.split(","):
        framework, sdp, ckpt, family = CAPACITY_FRAMEWORKS[label]
        points = []
        for depth in depths:
            case = case_from(args, family, framework=framework, sdp=sdp, layers=depth)
            case = replace(case, world=4, checkpointing=ckpt)
            row = next((r for r in old if r["case"] == asdict(case) and r["mmap_threshold"] == threshold), None)
            if row is None:
                row = run(case, args)
                row["label"] = label
                report(row)
            rows.append(row)
            points.append((depth, row["total_peak"], row["numel"]))
        if len(points) < 2:
            continue
        (d0, t0, n0), (d1, t1, n1) = sorted(points)[-2:]
        per_layer, per_layer_numel = (t1 - t0) / (d1 - d0), (n1 - n0) / (d1 - d0)
        largest = d1 + int((BUDGET_MIB - t1) // per_layer)
        total = t1 + (largest - d1) * per_layer
        print(
            f"  {label}: {per_layer:.1f} MiB per layer (sum over 4 ranks, depths {d0}-{d1}); within "
            f"{BUDGET_MIB / GIB:.0f} GiB: {largest} layers = {(n1 + (largest - d1) * per_layer_numel) / 1e9:.3f}B "
            f"parameters (predicted sum {total / GIB:.2f} GiB)",
            flush=True,
        )
        if args.confirm:
            free = mem_available_mib()
            if free < total + SPARE_MIB:
                need = f"{total / GIB:.1f} + {SPARE_MIB / GIB:.0f}"
                print(f"  {label}: not confirmed: {free / GIB:.1f} GiB available, the run needs {need}")
                continue
            case = replace(case_from(args, family, framework=framework, sdp=sdp, layers=largest), world=4)
            row = run(replace(case, checkpointing=ckpt), args)
            row["label"] = f"{label} (confirm)"
            report(row)
            rows.append(row)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--framework", choices=("shardpar", "fsdp2", "ddp"), default="shardpar")
    ap.add_argument("--model", choices=sorted(MODELS), default="168m")
    ap.add_argument("--layers", default=None, help="depth (one run) or depths 'a,b,...' (--capacity)")
    ap.add_argument("--world", type=int, default=0, help="ranks (default: sdp)")
    ap.add_argument("--sdp", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--bucket", type=float, default=5e8, help="sdp_reduce_bucket_size (elements)")
    ap.add_argument("--max-live", type=float, default=1e9, help="sdp_max_live_parameters (elements)")
    ap.add_argument("--backend", default="auto", help="ddp_dist_backend")
    ap.add_argument("--persistence-threshold", type=float, default=1e6, help="sdp_param_persistence_threshold")
    ap.add_argument("--checkpointing", action="store_true", help="HF gradient checkpointing (non-reentrant)")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32", help="shardpar's precision")
    ap.add_argument("--shard-optimizer-state", action="store_true", help="the shard_optimizer_state knob")
    ap.add_argument("--mmap-threshold", type=int, default=0, help="MALLOC_MMAP_THRESHOLD_ for the ranks (bytes)")
    ap.add_argument("--rev", default=None, help="git revision of shardpar to measure instead of the checkout")
    ap.add_argument("--calibrate", action="store_true", help="run the estimator's calibration matrix")
    ap.add_argument("--capacity", default=None, help=f"fit the capacity of {','.join(CAPACITY_FRAMEWORKS)}")
    ap.add_argument("--reuse", default=None, help="--capacity: take runs already measured from these JSON files")
    ap.add_argument("--confirm", action="store_true", help="--capacity: run the predicted largest model")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--timeout", type=float, default=1800.0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)  # inherited by the spawned ranks
    command = "benchmarks/bench_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.calibrate:
        rows = calibrate(args)
    elif args.capacity:
        rows = capacity(args)
    else:
        label, path = snapshot(args.rev)
        sdp = 1 if args.framework == "ddp" else args.sdp
        layers = int(args.layers) if args.layers else None
        try:
            case = case_from(args, args.model, framework=args.framework, sdp=sdp, layers=layers)
            rows = [run(case, args, path, label)]
        finally:
            if path != REPO:
                shutil.rmtree(path, ignore_errors=True)
        report(rows[0])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": command, "rows": rows}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
