"""Cases for test_snapshots.py (issue 32 item 2), run on every rank of a pool.

Training is checkpoint_cases' recipe (UnevenMLP, AdamW, LambdaLR, a fixed global batch). `straight_case`
trains 7 steps, snapshots steps 2 and 4 (the two files each rank keeps) and saves a disk checkpoint at
step 3, then "dies": it forgets its snapshots instead of removing them at shutdown, as a killed process
would. `resume_case` builds the model from another seed, resumes in a given damage mode, and trains on
to step 7: its losses must be the straight run's from the step it resumed at.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

import shardpar as smp
from shardpar.checkpoint import snapshot, snapshot_load
from tests.multiproc.checkpoint_cases import _build, _save, _train

STEPS = 7
JOB = "snaptest"  # the snapshot name, so a resume may point at another (empty) checkpoint directory


def _knobs(shm: str, **more: Any) -> dict[str, Any]:
    return {"checkpoint_snapshot_dir": shm, "checkpoint_snapshot_job": JOB, "checkpoint_snapshot_interval": 2, **more}


def straight_case(root: str, shm: str, knobs: dict[str, Any]) -> dict[str, Any]:
    model, opt, sched = _build(sdp=2, **_knobs(shm, **knobs))
    losses, written = [], []
    for step in range(STEPS):
        losses += _train(model, opt, sched, range(step, step + 1))
        done = step + 1
        content = {"step": done, "scheduler": sched.state_dict()}
        if done <= 4:  # steps 1..4: the interval (2) picks 2 and 4
            written.append(smp.save_snapshot(root, done, content))
        if done == 3:
            _save(root, "step3", model, opt, user_content=content)
    snapshot.written.clear()  # a crash: the files stay in shared memory
    return {"losses": losses, "written": written}


def resume_case(root: str, shm: str, knobs: dict[str, Any], mode: str) -> dict[str, Any]:
    """Damage the snapshots as `mode` says, resume from `root`, train to STEPS; shut down normally."""
    directory = snapshot.snapshot_dir(shm, JOB)
    rank = dist.get_rank()
    _damage(directory, rank, mode)
    dist.barrier()  # every rank damaged its files before any lists them
    model, opt, sched = _build(sdp=2, seed=123, **_knobs(shm, **knobs))
    if mode == "send" and rank == 1:  # as if rank 3's file were on another node: it must be sent
        listing = snapshot_load._listing
        snapshot_load._listing = lambda d, m: {**listing(d, m), "visible": {}}  # type: ignore[assignment]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            content = smp.resume_from_checkpoint(root)
    finally:
        snapshot_load._listing = _listing_original
    start = int(content["step"])
    sched.load_state_dict(content["scheduler"])
    source = smp.last_resume()
    losses = _train(model, opt, sched, range(start, STEPS))
    smp.shutdown()  # a normal finish: this rank's snapshots go
    dist.barrier()
    return {
        "start": start,
        "losses": losses,
        "source": source,
        "warnings": [str(w.message) for w in caught if "snapshot" in str(w.message)],
        "left": sorted(p.name for p in directory.iterdir()) if directory.exists() else None,
    }


_listing_original = snapshot_load._listing


def _damage(directory: Path, rank: int, mode: str) -> None:
    mine = [snapshot.file_of(directory, rank, slot) for slot in (0, 1)]
    newest = max((p for p in mine if p.exists()), key=lambda p: snapshot.read_trailer(p)["step"])  # type: ignore[index]
    if mode in ("peer", "send", "no_peer") and rank == 1:
        for p in mine:
            p.unlink()  # rank 1's node was replaced
    elif mode == "torn" and rank == 0:
        newest.unlink()  # rank 0 was killed while writing step 4: the others' step 2 is still there
    elif mode == "corrupt" and rank == 2:
        data = bytearray(newest.read_bytes())
        data[10] ^= 0x01  # one flipped bit in the tensor bytes
        newest.write_bytes(bytes(data))
