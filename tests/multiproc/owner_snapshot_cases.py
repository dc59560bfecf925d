"""Cases for test_owner_compute.py's snapshot test: smp.save_snapshot with an owner-stepped optimizer
(torch.optim.Muon for the hidden matrices + AdamW for the rest, one smp.DistributedOptimizer), world 4,
sdp 2 x 2 replicas. The straight run snapshots step 2, trains to step 4 and "dies" (its snapshots stay);
the resume starts from another seed with one rank's own snapshot files gone, so that rank reads its
replica peer's -- whose owner-held state must be the same -- and trains on to step 4.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

import shardpar as smp
from shardpar.checkpoint import snapshot
from tests.multiproc import checkpoint_cases as ck
from tests.multiproc import owner_cases

JOB = "ownersnap"
LOST = 1  # the rank whose own snapshot files are deleted before the resume


def _knobs(shm: str) -> dict[str, Any]:
    return {
        "sharded_data_parallel_degree": 2,
        "checkpoint_snapshot_dir": shm,
        "checkpoint_snapshot_job": JOB,
        "checkpoint_snapshot_interval": 2,
    }


def straight_case(root: str, shm: str) -> dict[str, Any]:
    model, opt = owner_cases._build_ckpt(_knobs(shm), 0)
    try:
        owner_cases._train_ckpt(model, opt, range(2))
        written = smp.save_snapshot(root, 2, {"step": 2})
        owned, at_snapshot = owner_cases.owned_state(opt), ck._full_state(model)
        losses = owner_cases._train_ckpt(model, opt, range(2, 4))
        snapshot.written.clear()  # a crash: the files stay in shared memory
        return {"written": written, "owned": owned, "at_snapshot": at_snapshot, "losses": losses}
    finally:
        smp.shutdown()


def resume_case(root: str, shm: str) -> dict[str, Any]:
    directory = snapshot.snapshot_dir(shm, JOB)
    if dist.get_rank() == LOST:
        for slot in (0, 1):
            snapshot.file_of(directory, LOST, slot).unlink(missing_ok=True)
    dist.barrier()
    model, opt = owner_cases._build_ckpt(_knobs(shm), 123)
    try:
        content = smp.resume_from_checkpoint(root)
        source = smp.last_resume()
        owned, resumed = owner_cases.owned_state(opt), ck._full_state(model)
        losses = owner_cases._train_ckpt(model, opt, range(int(content["step"]), 4))
        mine = sorted(f for f, _, is_mine in opt.owned_leaves() if is_mine)
        return {"source": source, "owned": owned, "resumed": resumed, "losses": losses, "mine": mine}
    finally:
        smp.shutdown()
