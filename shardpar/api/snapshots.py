"""`smp.save_snapshot(path, step)`: in-memory snapshots every `checkpoint_snapshot_interval` steps
([Note: in-memory snapshots], checkpoint/snapshot.py); `smp.resume_from_checkpoint(path)` considers them.

A snapshot belongs to the checkpoint directory `path` it accompanies: the same job started again
passes the same path to resume_from_checkpoint and finds it. `smp.shutdown()` on a normal finish
deletes this rank's snapshots (they are RAM); on an error or a preemption exit they stay for the next
start.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shardpar.api.context import get_config, is_initialized, state
from shardpar.checkpoint import snapshot as _snapshot
from shardpar.checkpoint import snapshot_load as _snapshot_load
from shardpar.optim.optimizer import DistributedOptimizer
from shardpar.runtime.model import DistributedModel


def snapshot_directory(path: str | os.PathLike[str]) -> Path:
    """Where the snapshots accompanying the checkpoint directory `path` go on this node."""
    cfg = get_config()
    return _snapshot.snapshot_dir(cfg.checkpoint_snapshot_dir, _snapshot.job_key(path, cfg.checkpoint_snapshot_job))


def save_snapshot(
    path: str | os.PathLike[str],
    step: int,
    user_content: Any = None,
    *,
    every: int | None = None,
    model: DistributedModel | None = None,
    optimizer: DistributedOptimizer | None = None,
) -> str | None:
    """Local (no collective; call on every rank with the same `step` after `optimizer.step()`): when `step`
    is a multiple of `every` (default: the `checkpoint_snapshot_interval` knob; 0 = off), copy this rank's
    shards, optimizer state, loss scaler, buffers, RNG and `user_content` (JSON, tuples, tensors: the step
    and data position) into host shared memory; the file written, or None when this step takes none."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"smp.save_snapshot(step={step!r}): pass the training step, an integer >= 0")
    interval = get_config().checkpoint_snapshot_interval if every is None else every
    if not isinstance(interval, int) or interval < 0:
        raise ValueError(f"smp.save_snapshot(every={every!r}) must be an integer >= 0 (0: no snapshots)")
    if interval == 0:
        return None
    st = state()
    model = model or st.model
    if model is None:
        raise ValueError("smp.save_snapshot needs a model: call smp.DistributedModel(model) first")
    if optimizer is None and st.optimizer is not None and st.optimizer.model is model:
        optimizer = st.optimizer
    if step % interval:
        return None
    model.window.check_save("smp.save_snapshot", "are not in a snapshot (a resume would step on the rest alone); save")
    directory = snapshot_directory(path)
    written = _snapshot.write(directory, model, optimizer, step=step, user_content=user_content)
    _snapshot.written.add(directory)
    return str(written)


def considered(path: str | os.PathLike[str]) -> Path:
    """The snapshot directory of `path`, which a resume is about to read: this process now answers for
    removing this rank's files there at a normal finish (an earlier incarnation wrote them)."""
    directory = snapshot_directory(path)
    _snapshot.written.add(directory)
    return directory


def discard_snapshots() -> None:
    """Delete this rank's snapshots written (or resumed from) by this process (local). smp.shutdown() calls
    it on a normal finish; call it yourself to free the RAM earlier."""
    if is_initialized():
        _snapshot.discard_written(state().topology.rank)
    else:
        _snapshot.written.clear()


def last_resume() -> dict[str, Any]:
    """What the last resume_from_checkpoint loaded: {"source": "memory" | "disk", "step"/"tag", "description"}
    ({} before any)."""
    return dict(_snapshot_load.last)
