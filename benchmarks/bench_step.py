"""Training-step time and peak memory: shardpar vs torch FSDP2 (HSDP) vs DeepSpeed ZeRO-3 vs plain PyTorch.

Every framework trains the same Hugging Face GPT-NeoX from the same seed on the same random tokens
(4 x 128 per rank) with AdamW and global-norm clipping at 1.0 (step_setups.py), on the same topology:

    world 1: one rank                          shardpar sdp 1, plain PyTorch
    world 2: one sharding group of 2           shardpar sdp 2, FSDP2 mesh (2,), ZeRO-3 over 2
    world 4: 2 sharding groups of 2 (2 reps)   shardpar sdp 2, FSDP2 mesh (rep 2, shard 2), ZeRO-3 over 4

plain also runs at world > 1, each rank training its own copy without communicating: the compute floor.
Each (framework, configuration) runs in freshly spawned ranks; the frameworks of a configuration run
in turn, rotating the order every repeat (A B C, B C A, ...), so the shared machine's noise hits them
alike, and every ratio compares rows of this one run. A step is forward + backward + clip + optimizer
step + zero_grad, timed on every rank after a barrier; a step counts as its slowest rank's time, and
the figure is the median over the measured steps of all quiet runs (warm-up steps discarded). A run is
noisy when other processes kept more than QUIET_SHARE of the cores busy during its steps (test suites
share this machine); a row with no quiet run uses all its runs and is marked noisy. Peak RSS is
each rank's ru_maxrss after its measured steps; growth subtracts its ru_maxrss after the imports and a
tiny primer step. The parent never imports torch, so it adds nothing to its children's ru_maxrss.

    .venv/bin/python benchmarks/bench_step.py                     # small model, fp32, world 1 2 4
    .venv/bin/python benchmarks/bench_step.py --model small,25m --dtype fp32,bf16 --repeats 2
    .venv/bin/python benchmarks/bench_step.py --frameworks shardpar,fsdp2 --world 2 --profile /tmp/prof
    .venv/bin/python benchmarks/bench_step.py --model small,25m --frameworks shardpar --baseline REV

--baseline REV adds a row shardpar@REV: shardpar as of git revision REV (its extension built from
REV's csrc when that differs from the checkout's), run exactly like shardpar and in turn with it; the
summary gives current / baseline.

DeepSpeed needs the `bench` extra (pyproject.toml) and runs with DS_ACCELERATOR=cpu on gloo; when it
cannot be imported its rows say why. Results and analysis: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

from spawn_ranks import collect, free_port  # benchmarks/, on the path when run as a script

FRAMEWORKS = (
    "shardpar", "fsdp2", "deepspeed", "plain", "shardpar-native", "shardpar-compile", "shardpar-muon",
    "shardpar-adafactor",
)  # fmt: skip
# shardpar-muon / -adafactor = shardpar stepping torch.optim.Muon (+AdamW for the rest) / Adafactor whole on
# owner ranks (issue 31); the "shardpar / this" column is then AdamW's step time over theirs. Opt-in.
# shardpar-native = shardpar on ddp_dist_backend "nccl" (gloo here), for the smddp-vs-native step;
# shardpar-compile = shardpar under torch.compile (inductor; --warmup must cover the compilation). Opt-in.
DEFAULT_FRAMEWORKS = FRAMEWORKS[:4]
MODELS = ("small", "25m")  # step_setups.MODELS (not imported here: it imports torch)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The targets: shardpar / anchor.
TIME_VS_SHARDED = 0.8  # step time vs FSDP2 HSDP and vs ZeRO-3
RSS_VS_FSDP2 = 1.0  # peak RSS per rank vs FSDP2
TIME_VS_PLAIN = 1.05  # step time at world 1 vs plain PyTorch
SMDDP_VS_NATIVE = 0.999  # issue 7: the smddp engine's step is faster than the native one's
# A run during which other processes kept more than this share of the cores busy is noisy: a rank
# that loses its core stalls every collective (and a 2-thread rank every parallel op) on it.
QUIET_SHARE = 0.15
CORES = os.cpu_count() or 1


@dataclass(frozen=True)
class Case:
    framework: str
    model: str
    world: int
    dtype: str
    sdp: int
    batch: int
    seq: int
    warmup: int
    steps: int
    persistence_threshold: int
    profile_dir: str | None = None
    shardpar_path: str | None = None  # a snapshot of the package, imported instead of the checkout


@dataclass(frozen=True)
class Run:
    """One launch of a case: its measured steps (slowest rank each) and its ranks' memory."""

    step_ms: list[float]
    phases_ms: list[tuple[float, float, float]]  # forward, backward, optimizer
    others: float  # share of the machine's cores other processes kept busy during the measured steps
    peak_mib: list[float]  # per rank
    growth_mib: list[float]
    shm_mib: list[float]  # per rank: shared memory (transport segments) in RSS after the steps
    loss: float  # mean over ranks, last step
    cpu_ms: list[float]  # per step: CPU time of all ranks (all their threads), less sensitive to load
    faults: list[int]  # per step: minor page faults of all ranks

    @property
    def quiet(self) -> bool:
        return self.others <= QUIET_SHARE


@dataclass
class Result:
    case: Case
    status: str = "ok"  # ok | failed | skipped
    error: str = ""
    runs: list[Run] = field(default_factory=list)

    def counted(self) -> list[Run]:
        """The quiet runs, or every run when none was quiet (then the row is marked noisy)."""
        return [r for r in self.runs if r.quiet] or self.runs

    @property
    def median_ms(self) -> float:
        return statistics.median(ms for r in self.counted() for ms in r.step_ms)

    def median_phases_ms(self) -> list[float]:
        return [statistics.median(p[k] for r in self.counted() for p in r.phases_ms) for k in range(3)]

    @property
    def peak_mib(self) -> float:
        """Largest peak RSS of any rank in any run (memory does not depend on the machine's load)."""
        return max(max(r.peak_mib) for r in self.runs)

    @property
    def growth_mib(self) -> float:
        return max(max(r.growth_mib) for r in self.runs)

    @property
    def shm_mib(self) -> float:
        return max(max(r.shm_mib) for r in self.runs)


def machine_busy_s() -> float:
    """CPU seconds all cores have spent busy since boot (/proc/stat: user + nice + system + steal;
    irq and softirq are left out: our own ranks' loopback traffic lands there)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    return (ticks[0] + ticks[1] + ticks[2] + ticks[7]) / os.sysconf("SC_CLK_TCK")


def wait_quiet(max_wait_s: float, *, window_s: float = 2.0) -> None:
    """Wait at most `max_wait_s` for other processes (test suites run here in bursts) to leave the
    machine nearly idle."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        b0 = machine_busy_s()
        time.sleep(window_s)
        if (machine_busy_s() - b0) / (window_s * CORES) <= QUIET_SHARE:
            return


# ---- ranks (spawned; only they import torch) ------------------------------------------------------


def _rank_entry(case: Case, rank: int, port: int, queue: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(case.world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(case.world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DS_ACCELERATOR="cpu",  # read by deepspeed only
    )
    if case.shardpar_path is not None:
        sys.path.insert(0, case.shardpar_path)
    try:
        import step_setups

        queue.put((rank, "ok", step_setups.run_rank(case, rank)))
    except BaseException:
        queue.put((rank, "err", traceback.format_exc()))
        raise SystemExit(1) from None


def launch(case: Case, timeout_s: float) -> list[dict[str, Any]]:
    """Run `case` on `case.world` spawned ranks: their results in rank order, or RuntimeError."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(case, r, port, queue)) for r in range(case.world)]
    for p in procs:
        p.start()
    return collect(procs, queue, case.world, timeout_s)


# ---- the runs -------------------------------------------------------------------------------------


def deepspeed_problem() -> str:
    """Why DeepSpeed cannot run here ('' when it imports with the CPU accelerator), checked in a child."""
    probe = "import deepspeed.accelerator as a; assert a.get_accelerator()._name == 'cpu'"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        return "deepspeed unusable: " + (proc.stderr.strip().splitlines() or ["import failed"])[-1]
    return ""


def snapshot_shardpar() -> str:
    """Copy the checkout's shardpar package (with its built extension) into a temporary folder, so the
    whole command measures one version while others keep editing the checkout."""
    dst = tempfile.mkdtemp(prefix="bench_step_")
    ignore = shutil.ignore_patterns("__pycache__", "csrc")
    shutil.copytree(os.path.join(REPO, "shardpar"), os.path.join(dst, "shardpar"), ignore=ignore)
    return dst


def snapshot_revision(rev: str) -> tuple[str, str]:
    """The row name shardpar@<short hash> and a temporary folder holding shardpar as of git revision
    `rev`, with its extension: the checkout's built one when csrc is the same at REV, else REV's csrc
    built there with REV's setup.py (the Python side calls the C side through ctypes, unchecked)."""
    git = ["git", "-C", REPO]
    short = subprocess.run([*git, "rev-parse", "--short", f"{rev}^{{commit}}"], capture_output=True, text=True)
    if short.returncode != 0:
        raise ValueError(f"--baseline {rev}: not a git revision of {REPO} ({short.stderr.strip()})")
    label, dst = f"shardpar@{short.stdout.strip()}", tempfile.mkdtemp(prefix="bench_step_base_")
    archive = subprocess.run([*git, "archive", rev, "shardpar", "setup.py"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", dst], input=archive.stdout, check=True)
    if subprocess.run([*git, "diff", "--quiet", rev, "--", "shardpar/csrc"]).returncode == 0:
        for name in os.listdir(os.path.join(REPO, "shardpar")):
            if name.startswith("_shm") and name.endswith(".so"):
                shutil.copy2(os.path.join(REPO, "shardpar", name), os.path.join(dst, "shardpar"))
    else:
        print(f"{label}: shardpar/csrc differs from the checkout's; building its own extension", flush=True)
        build = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
        proc = subprocess.run(build, cwd=dst, capture_output=True, text=True)
        if not any(n.startswith("_shm") and n.endswith(".so") for n in os.listdir(os.path.join(dst, "shardpar"))):
            shutil.rmtree(dst, ignore_errors=True)
            raise ValueError(f"--baseline {rev}: building its shardpar/csrc failed:\n{proc.stderr.strip()}")
    shutil.rmtree(os.path.join(dst, "shardpar", "csrc"), ignore_errors=True)
    return label, dst


def _record(res: Result, ranks: list[dict[str, Any]]) -> Run:
    src, snap = ranks[0]["shardpar_file"], res.case.shardpar_path
    if src is not None and snap is not None and not src.startswith(snap):
        raise RuntimeError(f"shardpar was imported from {src}, not from the snapshot {snap}")
    steps = range(len(ranks[0]["times"]))
    wall = [max(r["times"][i] for r in ranks) for i in steps]
    # rank 0 saw the whole machine's busy time over each step; the ranks' own CPU time is ours
    others = sum(max(0.0, ranks[0]["busy"][i] - sum(r["cpu"][i] for r in ranks)) for i in steps)
    run = Run(
        step_ms=[w * 1e3 for w in wall],
        phases_ms=[tuple(max(r["phases"][i][k] for r in ranks) * 1e3 for k in range(3)) for i in steps],
        others=others / (sum(wall) * CORES),
        peak_mib=[r["peak"] for r in ranks],
        growth_mib=[r["peak"] - r["baseline"] for r in ranks],
        shm_mib=[r["shm"] for r in ranks],
        loss=statistics.fmean(r["loss"] for r in ranks),
        cpu_ms=[sum(r["cpu"][i] for r in ranks) * 1e3 for i in steps],
        faults=[sum(r["faults"][i] for r in ranks) for i in steps],
    )
    res.runs.append(run)
    return run


def _run_case(res: Result, rep: int, args: argparse.Namespace) -> None:
    c = res.case
    if res.status != "ok":
        return
    label = f"{c.framework:16s} {c.model:5s} world {c.world} {c.dtype} run {rep}"
    wait_quiet(args.quiet_wait)
    t0 = time.monotonic()
    try:
        run = _record(res, launch(c, args.timeout))
    except RuntimeError as err:
        res.status, res.error = "failed", str(err)
        print(f"{label}: FAILED\n{err}", flush=True)
        return
    print(
        f"{label}: median {statistics.median(run.step_ms):7.1f} ms  others {run.others:4.0%}"
        f"{'' if run.quiet else ' (noisy)'}  peak RSS {max(run.peak_mib):5.0f} MiB  loss {run.loss:.4f}"
        f"  cpu {statistics.median(run.cpu_ms):6.0f} ms  faults {statistics.median(run.faults) / 1e3:5.1f} k"
        f"  ({time.monotonic() - t0:.0f} s)",
        flush=True,
    )


def run_all(args: argparse.Namespace, paths: dict[str, str | None]) -> list[Result]:
    """`paths`: the frameworks to run, each with the shardpar snapshot its ranks import (None: the checkout)."""
    wanted = list(paths)
    ds_problem = deepspeed_problem() if "deepspeed" in wanted else ""
    results: list[Result] = []
    for model in args.model.split(","):
        for world in [int(w) for w in args.world.split(",")]:
            for dtype in args.dtype.split(","):
                # The sharded anchors need 2+ ranks; world 1 compares shardpar (eager, compiled) with plain PyTorch.
                single = ("shardpar", "plain", "shardpar-compile")
                frameworks = [f for f in wanted if world > 1 or f.split("@")[0] in single]
                row = [
                    Result(
                        Case(
                            fw,
                            model,
                            world,
                            dtype,
                            sdp=min(args.sdp, world),
                            batch=args.batch,
                            seq=args.seq,
                            warmup=args.warmup,
                            steps=args.steps,
                            persistence_threshold=args.persistence_threshold,
                            profile_dir=args.profile,
                            shardpar_path=paths[fw],
                        )
                    )
                    for fw in frameworks
                ]
                for res in row:
                    if res.case.framework == "deepspeed" and ds_problem:
                        res.status, res.error = "skipped", ds_problem
                for rep in range(args.repeats):
                    for i in range(len(row)):
                        _run_case(row[(i + rep) % len(row)], rep, args)
                # A row whose runs all had company gets extra runs (still in turn with the others).
                for extra in range(args.retries):
                    for res in [r for r in row if r.runs and not any(run.quiet for run in r.runs)]:
                        _run_case(res, args.repeats + extra, args)
                results += row
    return results


# ---- report ---------------------------------------------------------------------------------------


def _find(results: list[Result], framework: str, like: Case) -> Result | None:
    """The measured row of `framework` at the configuration of `like`."""
    for r in results:
        c = r.case
        if (
            r.status == "ok"
            and r.runs
            and (c.framework, c.model, c.world, c.dtype) == (framework, like.model, like.world, like.dtype)
        ):
            return r
    return None


def _ratio(mine: float, theirs: float) -> str:
    return f"{mine / theirs:.2f}" if theirs > 0 else "-"


def _layout(c: Case) -> str:
    """Sharding degree x replicas as each framework runs it."""
    if c.framework == "plain":
        return f"1 x {c.world} (no comm)" if c.world > 1 else "1 x 1"
    if c.framework == "deepspeed":
        return f"{c.world} x 1"  # ZeRO-3 shards over the whole world (no MiCS upstream any more)
    return f"{c.sdp} x {c.world // c.sdp}"


def table(results: list[Result]) -> str:
    """All rows; the ratio columns are shardpar / this row (< 1: shardpar is faster or smaller)."""
    lines = [
        "| framework | model | world | sdp x rep | dtype | step ms | run medians (* noisy) | shardpar / this "
        "| fwd / bwd / opt ms | peak RSS MiB/rank | shardpar / this | RSS growth MiB | shm MiB | loss |",
        "|" + "---|" * 14,
    ]
    for res in results:
        c = res.case
        cells = [c.framework, c.model, str(c.world), _layout(c), c.dtype]
        if res.status != "ok" or not res.runs:
            why = res.error.strip().splitlines()[-1] if res.error else ""
            lines.append("| " + " | ".join([*cells, f"{res.status}: {why}", *[""] * 8]) + " |")
            continue
        sp = _find(results, "shardpar", c)
        cells += [
            f"{res.median_ms:.1f}",
            " ".join(f"{statistics.median(r.step_ms):.0f}{'' if r.quiet else '*'}" for r in res.runs),
            _ratio(sp.median_ms, res.median_ms) if sp else "-",
            " / ".join(f"{p:.0f}" for p in res.median_phases_ms()),
            f"{res.peak_mib:.0f}",
            _ratio(sp.peak_mib, res.peak_mib) if sp else "-",
            f"{res.growth_mib:.0f}",
            f"{res.shm_mib:.0f}",
            f"{res.runs[-1].loss:.4f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(results: list[Result]) -> str:
    """The issue's targets per configuration: the ratio and whether it is met."""

    def check(sp: Result, other: Result | None, limit: float, *, rss: bool = False) -> str:
        if other is None:
            return "-"
        ratio = sp.peak_mib / other.peak_mib if rss else sp.median_ms / other.median_ms
        # memory does not depend on the machine's load; time does
        noisy = not rss and not all(r.quiet for res in (sp, other) for r in res.counted())
        return f"{ratio:.3f} {'met' if ratio <= limit else 'MISSED'}{' (noisy)' if noisy else ''}"

    lines = [
        f"| model | world | dtype | time / FSDP2 (<= {TIME_VS_SHARDED}) | time / ZeRO-3 (<= {TIME_VS_SHARDED}) "
        f"| peak RSS / FSDP2 (<= {RSS_VS_FSDP2}) | time / plain, world 1 (<= {TIME_VS_PLAIN}) "
        "| time smddp / native engine (< 1) |",
        "|" + "---|" * 8,
    ]
    for sp in results:
        c = sp.case
        if c.framework != "shardpar" or sp.status != "ok":
            continue
        fsdp2 = _find(results, "fsdp2", c)
        cells = [
            check(sp, fsdp2, TIME_VS_SHARDED),
            check(sp, _find(results, "deepspeed", c), TIME_VS_SHARDED),
            check(sp, fsdp2, RSS_VS_FSDP2, rss=True),
            check(sp, _find(results, "plain", c), TIME_VS_PLAIN) if c.world == 1 else "-",
            check(sp, _find(results, "shardpar-native", c), SMDDP_VS_NATIVE),
        ]
        lines.append(f"| {c.model} | {c.world} | {c.dtype} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def versus_baseline(results: list[Result], baseline: str) -> str:
    """Per configuration: shardpar's step time and peak RSS over those of the `baseline` row."""
    lines = [
        f"| model | world | dtype | step ms shardpar / {baseline} | ratio "
        f"| peak RSS MiB shardpar / {baseline} | ratio |",
        "|" + "---|" * 7,
    ]
    for sp in results:
        c = sp.case
        base = _find(results, baseline, c)
        if c.framework != "shardpar" or sp.status != "ok" or base is None:
            continue
        noisy = "" if all(r.quiet for res in (sp, base) for r in res.counted()) else " (noisy)"
        cells = [
            f"{sp.median_ms:.1f} / {base.median_ms:.1f}",
            _ratio(sp.median_ms, base.median_ms) + noisy,
            f"{sp.peak_mib:.0f} / {base.peak_mib:.0f}",
            _ratio(sp.peak_mib, base.peak_mib),
        ]
        lines.append(f"| {c.model} | {c.world} | {c.dtype} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def environment() -> dict[str, str]:
    """Versions, CPU and the shardpar revision measured (read without importing torch)."""
    from importlib import metadata

    env = {"date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(), "cores": str(os.cpu_count())}
    for name in ("torch", "transformers", "deepspeed"):
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name] = "not installed"
    with open("/proc/cpuinfo") as f:
        env["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    git = ["git", "-C", REPO]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--", "shardpar"], capture_output=True, text=True).stdout
    env["shardpar"] = head + (" + uncommitted changes" if dirty.strip() else "")
    return env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--frameworks", default=",".join(DEFAULT_FRAMEWORKS), help="subset of " + ",".join(FRAMEWORKS))
    p.add_argument("--model", default="small", help="small (3.7M parameters), 25m (26.3M)")
    p.add_argument("--world", default="1,2,4", help="world sizes (ranks on this machine)")
    p.add_argument("--dtype", default="fp32", help="fp32, bf16")
    p.add_argument("--sdp", type=int, default=2, help="sharding degree (capped at the world size)")
    p.add_argument("--steps", type=int, default=8, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=3, help="steps run and discarded before measuring")
    p.add_argument("--repeats", type=int, default=2, help="runs per framework, interleaved with the others")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument(
        "--persistence-threshold",
        type=int,
        default=1000,
        help="shardpar sdp_param_persistence_threshold = ZeRO-3 stage3_param_persistence_threshold "
        "(1000: weight matrices sharded, biases and norms replicated; FSDP2 shards everything)",
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=30.0,
        help=f"before each run, wait up to this many seconds for other processes to use <= {QUIET_SHARE * 100:.0f}%% "
        "of the cores",
    )
    p.add_argument("--retries", type=int, default=1, help="extra runs for a row that had no quiet run")
    p.add_argument("--profile", default=None, metavar="DIR", help="also profile one step per rank into DIR")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--no-snapshot", dest="snapshot", action="store_false", help="import shardpar from the checkout")
    p.add_argument(
        "--baseline",
        default=None,
        metavar="REV",
        help="also run shardpar as of git revision REV (row shardpar@REV), in turn with the others",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write every result (all step times) as JSON")
    args = p.parse_args(argv)
    for name, allowed in (("frameworks", FRAMEWORKS), ("dtype", ("fp32", "bf16")), ("model", MODELS)):
        bad = [v for v in getattr(args, name).split(",") if v not in allowed]
        if bad:
            p.error(f"--{name}: {bad} not in {allowed}")
    if args.baseline is not None and "shardpar" not in args.frameworks.split(","):
        p.error(f"--baseline {args.baseline} is compared with shardpar: add shardpar to --frameworks")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = environment()
    print("bench_step: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    print("command: " + " ".join([os.path.relpath(sys.executable), *sys.argv]), flush=True)
    t0 = time.monotonic()
    try:
        baseline = snapshot_revision(args.baseline) if args.baseline else None
    except ValueError as err:
        raise SystemExit(f"bench_step: {err}") from None
    snapshot = snapshot_shardpar() if args.snapshot else None
    paths: dict[str, str | None] = dict.fromkeys(args.frameworks.split(","), snapshot)
    if baseline is not None:
        paths[baseline[0]] = baseline[1]
    try:
        results = run_all(args, paths)
    finally:
        for path in {p for p in paths.values() if p is not None}:
            shutil.rmtree(path, ignore_errors=True)
    summary = f"{table(results)}\n\n{targets(results)}"
    if baseline is not None:
        summary += f"\n\n{versus_baseline(results, baseline[0])}"
    print(f"\n{summary}\n\ntotal {time.monotonic() - t0:.0f} s")
    if args.json:
        rows = [{**asdict(r), "median_ms": r.median_ms if r.runs else None} for r in results]
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "environment": env, "results": rows}, f, indent=1)
    return 0 if all(r.status != "failed" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
