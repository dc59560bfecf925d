"""Recovery after kill -9 of one rank: from the in-memory snapshot vs from the disk checkpoint (issue 32 item 2).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_recovery.py [--world 4] [--sdp 2] [--hidden 512] [--layers 8]
        [--vocab 50304] [--repeats 2] [--kinds memory,disk,disk-cold | --cold-disk]

1. train: `world` CPU ranks (our launcher, gloo + shm) train 2 steps of a GPT-NeoX (fp32, AdamW), save a
   disk checkpoint and a snapshot of the same step, then rank 1 kills itself with SIGKILL; the others
   see it die in their next collective and are killed as torchrun would kill them (SIGKILL: no cleanup).
2. restart, alternately `--repeats` times each: a fresh launch builds the model, resumes -- from the
   snapshots in /dev/shm (the default), or from the disk checkpoint alone (snapshots=False) -- and runs
   one step. Per rank: seconds from the launch to the model built, to the state loaded, to the step done.
   The slowest rank counts (the step is collective). Both must load the same state: the first new
   step's loss is compared (exactly).

Two disk cases: "disk" reads the checkpoint just written, from the page cache (the disk side favoured);
"disk-cold" first drops the checkpoint's files from the page cache (posix_fadvise DONTNEED on each file:
only its clean pages, nothing else's; mincore(2) then reports how much stayed cached), so the restart
reads the local disk, still faster than the remote storage a cluster restarts from. `--cold-disk` runs
memory against disk-cold only. Target: memory to the first new step <= 0.3 x from disk.

Where a restart's time goes, per phase (slowest rank, medians): python up, import torch + shardpar,
import transformers, smp.init (rendezvous), model + optimizer built, resume_from_checkpoint, first step.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import signal
import statistics
import tempfile
import time
from typing import Any

# In a spawned rank this module is imported (as __mp_main__) right after the interpreter starts, before
# the launcher unpickles the rank's function (which imports shardpar and torch): the end of "start".
_MODULE_IMPORTED = time.time()

# A restart's phases, in order; each ends at a timestamp taken on every rank (the slowest rank counts).
PHASES = (
    ("start", "python up (spawn)"),
    ("import", "import torch + shardpar (launcher)"),
    ("transformers", "import transformers"),
    ("rendezvous", "smp.init (process groups)"),
    ("build", "model + optimizer built"),
    ("load", "resume_from_checkpoint"),
    ("step", "first new step"),
)


def _build(
    sdp: int, hidden: int, layers: int, vocab: int, marks: dict[str, float] | None = None
) -> tuple[Any, Any, Any]:
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    import shardpar as smp

    marks = {} if marks is None else marks
    marks["transformers"] = time.time()
    torch.set_num_threads(1)
    smp.init({"sharded_data_parallel_degree": sdp, "sdp_param_persistence_threshold": 1000})
    marks["rendezvous"] = time.time()
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
        intermediate_size=4 * hidden, max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    model = smp.DistributedModel(GPTNeoXForCausalLM(cfg))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    return model, opt, cfg


def _step(model: Any, opt: Any, cfg: Any, step: int) -> float:
    import torch

    import shardpar as smp

    gen = torch.Generator().manual_seed(1000 * step + smp.rdp_rank())  # the data of a step, as a recipe's
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    model.backward(loss)
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _train_then_die(root: str, sdp: int, hidden: int, layers: int, vocab: int) -> None:
    import shardpar as smp

    model, opt, cfg = _build(sdp, hidden, layers, vocab)
    for step in range(2):
        _step(model, opt, cfg, step)
    smp.save_checkpoint(root, "step2", model=model, optimizer=opt, user_content={"step": 2})
    smp.save_snapshot(root, 2, {"step": 2}, every=1)
    smp.barrier()
    if smp.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        smp.allgather(0)  # rank 1 is gone: this raises (or times out)
    finally:
        os.kill(os.getpid(), signal.SIGKILL)  # what torchrun does to the survivors: no cleanup either


def _restart(launched: float, root: str, memory: bool, sdp: int, hidden: int, layers: int, vocab: int) -> dict:
    marks = {"start": _MODULE_IMPORTED, "import": time.time()}  # the launcher imported torch and shardpar
    import shardpar as smp
    from shardpar.checkpoint import snapshot

    model, opt, cfg = _build(sdp, hidden, layers, vocab, marks)
    built = marks["build"] = time.time()
    content = smp.resume_from_checkpoint(root, snapshots=memory)
    loaded = marks["load"] = time.time()
    loss = _step(model, opt, cfg, int(content["step"]))
    stepped = marks["step"] = time.time()
    source = smp.last_resume().get("source")
    snapshot.written.clear()  # keep the snapshots for the next repeat (a normal finish would remove them)
    smp.shutdown()
    return {"built": built - launched, "loaded": loaded - launched, "stepped": stepped - launched,
            "resume_and_step": stepped - built, "loss": loss, "source": source,
            "marks": {k: v - launched for k, v in marks.items()}}  # fmt: skip


def _drop_from_page_cache(directory: str) -> tuple[int, int]:
    """posix_fadvise(DONTNEED) on each file of `directory` (only these files' clean pages: not a global
    drop_caches, which would slow every other process on the machine); (bytes resident after, total)."""
    for entry in os.scandir(directory):
        fd = os.open(entry.path, os.O_RDONLY)
        try:
            os.fsync(fd)  # only clean pages can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return _resident(directory)


def _resident(directory: str) -> tuple[int, int]:
    """(bytes of the files of `directory` in the page cache, their size), by mincore(2) on a mapping of
    each file -- what util-linux's fincore reports -- so the "cold" case shows that it was cold."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    resident = total = 0
    for entry in os.scandir(directory):
        size = entry.stat().st_size
        total += size
        if not size:
            continue
        fd = os.open(entry.path, os.O_RDONLY)
        try:  # mapping reads nothing: mincore only looks at which pages are cached
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {entry.path} failed")
            try:
                vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {entry.path} failed")
                resident += sum(v & 1 for v in vec) * page
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return min(resident, total), total


def _print_phases(rows: dict[str, list[dict]]) -> None:
    """Where a restart's time goes: per phase, seconds from the previous phase's end (the slowest rank's
    timestamps, medians over the repeats); "start" counts from the launch call in this process."""
    print(f"{'phase (slowest rank, median s)':47s}" + "".join(f"{k:>11s}" for k in rows))
    prev = {k: [0.0] * len(rows[k]) for k in rows}
    for mark, what in PHASES:
        cells = []
        for k, runs in rows.items():
            cells.append(statistics.median(r["marks"][mark] - p for r, p in zip(runs, prev[k], strict=True)))
            prev[k] = [r["marks"][mark] for r in runs]
        print(f"{mark:12s} {what:34s}" + "".join(f"{c:11.2f}" for c in cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--sdp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kinds", default="memory,disk,disk-cold", help="restarts to run, alternately (default: all 3)")
    p.add_argument(
        "--cold-disk", action="store_true", help="memory against the cold disk only (--kinds memory,disk-cold)"
    )
    a = p.parse_args()
    kinds = ["memory", "disk-cold"] if a.cold_disk else a.kinds.split(",")
    if not set(kinds) <= {"memory", "disk", "disk-cold"} or "memory" not in kinds or len(kinds) < 2:
        p.error(f"--kinds {a.kinds!r}: memory and one or both of disk, disk-cold (comma-separated)")
    from shardpar.checkpoint import snapshot
    from shardpar.cli.launcher import LaunchError, launch_local

    shape = (a.sdp, a.hidden, a.layers, a.vocab)
    tmp = tempfile.mkdtemp(prefix="bench-recovery-")
    root = os.path.join(tmp, "ckpt")
    shm = snapshot.snapshot_dir("/dev/shm", snapshot.job_key(root, None))
    try:
        try:
            launch_local(_train_then_die, a.world, root, *shape, timeout_s=1800)
        except LaunchError as e:
            print(f"train: the launch ended as expected ({str(e).splitlines()[0][:100]})")
        files = sorted(shm.glob("rank*.snap"))
        snap_bytes = sum(f.stat().st_size for f in files)
        disk_bytes = sum(f.stat().st_size for f in (os.scandir(os.path.join(root, "step2_partial"))))
        print(
            f"snapshots: {len(files)} files, {snap_bytes / 2**20:.0f} MiB; disk checkpoint {disk_bytes / 2**20:.0f} MiB"
        )
        rows: dict[str, list[dict]] = {k: [] for k in kinds}
        for _ in range(a.repeats):
            for kind in rows:
                if kind == "disk-cold":
                    cached, size = _drop_from_page_cache(os.path.join(root, "step2_partial"))
                    print(f"disk-cold: {cached / 2**20:.1f} of {size / 2**20:.0f} MiB of the checkpoint cached")
                res = launch_local(_restart, a.world, time.time(), root, kind == "memory", *shape, timeout_s=1800)
                slowest = {k: max(r[k] for r in res) for k in ("built", "loaded", "stepped", "resume_and_step")}
                slowest["marks"] = {m: max(r["marks"][m] for r in res) for m, _ in PHASES}
                slowest["loss"] = res[0]["loss"]
                assert all(r["source"] == kind.split("-")[0] for r in res), [r["source"] for r in res]
                rows[kind].append(slowest)
                print(f"{kind:6s} launch->built {slowest['built']:.2f} s, ->loaded {slowest['loaded']:.2f} s, "
                      f"->first step {slowest['stepped']:.2f} s; resume+step {slowest['resume_and_step']:.2f} s, "
                      f"loss {slowest['loss']!r}")  # fmt: skip
        losses = {r["loss"] for k in rows for r in rows[k]}
        assert len(losses) == 1, f"memory and disk resumes disagree: {losses}"
        _print_phases(rows)
        numbers = ("built", "loaded", "stepped", "resume_and_step")
        med = {k: {m: statistics.median(r[m] for r in rows[k]) for m in numbers} for k in rows}
        load = {k: med[k]["loaded"] - med[k]["built"] for k in med}
        mem = med["memory"]
        for disk in [k for k in rows if k != "memory"]:
            d = med[disk]
            print(
                f"median, memory vs {disk}: load {load['memory']:.2f} s vs {load[disk]:.2f} s = "
                f"{load['memory'] / load[disk]:.2f}x; load + first step {mem['resume_and_step']:.2f} s vs "
                f"{d['resume_and_step']:.2f} s = {mem['resume_and_step'] / d['resume_and_step']:.2f}x; launch -> "
                f"first step {mem['stepped']:.2f} s vs {d['stepped']:.2f} s = {mem['stepped'] / d['stepped']:.2f}x"
            )
        print(f"every restart's first new step had the same loss {losses.pop()!r}")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
