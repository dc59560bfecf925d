"""Asynchronous partial checkpoints: `save_checkpoint(..., async_save=True)` stages this rank's tensors
into reused host buffers and returns; a background thread writes and fsyncs this rank's file.

[Note: async checkpoint commit]
The commit (every rank agrees its file is durable, rank 0 writes the index, renames the directory,
moves `newest`, prunes to keep-N) is a sequence of collectives on the world group. It never runs on
the writer thread: a collective issued from a background thread would interleave with the training
collectives of the main thread in a different order on different ranks (rank 0's writer reaching its
all-gather while rank 1's main thread is in a ReduceScatter), which deadlocks or, worse, matches the
wrong operations. So the writer thread only writes this rank's file (the checksums are computed
while writing, the file is fsynced), and the commit runs on the main thread at a point every rank
reaches in the same order: the next save (which therefore waits for the previous write), a resume,
`wait_for_checkpoint()` (the recipes call it after the last step and before exiting on preemption),
or `poll()`, which the training loop may call at every step (one small all-gather while a save is
pending: "is everyone's writer done?"; the commit follows when all are). Until the commit `newest`
names the previous checkpoint, so a crash during the write (or before the commit) leaves the previous
checkpoint in force; the half-written `.tmp-*` directory is swept by the next save or resume. (The
torch.distributed store would allow a thread-safe agreement too, but `newest` must still move on one
rank after all agreed; the main-thread points reuse the synchronous save's agreement code unchanged.)

Staging: the fp32 shards, optimizer state and buffers this rank writes are copied into host buffers
(pinned when the source is on CUDA) that are kept and reused by the next save of the same layout, so
the optimizer may update the originals as soon as the call returns. The writer reads only the
staging buffers, and the next save reuses them only after the previous write finished.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardpar.checkpoint import atomic
from shardpar.checkpoint import partial as _partial
from shardpar.checkpoint.atomic import Coordinator

# How long the commit waits for this rank's writer before it abandons the checkpoint (a hung filesystem):
# every wait has a bound. Generous: a slow disk writing gigabytes is not an error.
WRITE_TIMEOUT_S = 1800.0

# Test hook: called on the writer thread before it writes (a test holds it on an Event to prove that
# training goes on meanwhile, or raises to simulate a failing disk).
before_write: Callable[[str], None] | None = None


class Staging:
    """Host copies of this rank's tensors, one buffer per key, reused while key, dtype and shape repeat."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        staged: dict[str, torch.Tensor] = {}
        on_cuda = False
        for key, t in tensors.items():
            src = t.detach()
            buf = self._buffers.get(key)
            if buf is None or buf.dtype != src.dtype or buf.shape != src.shape:
                pin = src.is_cuda  # pinned: the device-to-host copy runs as one DMA, and may overlap
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
                self._buffers[key] = buf
            buf.copy_(src, non_blocking=src.is_cuda)
            on_cuda = on_cuda or src.is_cuda
            staged[key] = buf
        if on_cuda:
            torch.cuda.synchronize()  # the copies are complete before the caller returns to training
        for key in [k for k in self._buffers if k not in staged]:
            del self._buffers[key]  # a layout that changed: do not keep memory nobody writes
        return staged


@dataclass
class _Pending:
    job: _partial.SaveJob
    coord: Coordinator
    held: list[atomic.TmpDir]
    report: dict[str, Any]
    thread: threading.Thread | None = None
    error: Exception | None = None
    done: threading.Event = field(default_factory=threading.Event)


_pending: _Pending | None = None
_staging = Staging()


def staging_bytes() -> int:
    """Host bytes this process keeps for staging async saves (reused by every save of the same layout)."""
    return _staging.nbytes


def pending_tag() -> str | None:
    return _pending.job.tag if _pending is not None else None


def start(coord: Coordinator, job: _partial.SaveJob, held: list[atomic.TmpDir]) -> Path:
    """Stage this rank's tensors, freeze the index's model-side entries, start the writer; the final path.

    Local (no collective). The caller has waited for any previous async save (`finish`).
    """
    global _pending
    if _pending is not None:
        raise AssertionError("an async save is still pending: finish() it first")
    model, optimizer = job.model, job.optimizer
    staged: dict[str, torch.Tensor] = {}
    report: dict[str, Any] = {}

    # No agreement here (it would be one more collective in the stall): a rank whose staging fails keeps
    # the error, starts no writer, and the commit raises it on every rank like a failed write.
    pending = _Pending(job, coord, held, report)
    try:
        tensors, rep = _partial.collect_rank_file(model, optimizer)
        staged.update(_staging.stage(tensors))
        report.update(rep)
        if coord.is_root:
            job.freeze()  # lr, loss scaler, backward count as of this call, not as of the commit
    except Exception as e:
        pending.error = e
    rank = model.topology.coords.rank

    def write() -> None:
        try:
            if before_write is not None:
                before_write(job.tag)
            _partial.write_collected(job.tmp, job.checkpoint_id, rank, staged, report)
        except Exception as e:  # reported to every rank at the commit
            pending.error = e
        finally:
            pending.done.set()

    _pending = pending
    if pending.error is not None:
        pending.done.set()
        return job.final
    pending.thread = threading.Thread(target=write, name=f"shardpar-ckpt-writer-{job.tag}", daemon=True)
    pending.thread.start()
    return job.final


def poll() -> bool:
    """Collective, at the same point on every rank (e.g. after each optimizer step): commit the pending
    async save when every rank's writer is done. True when nothing is pending any more."""
    if _pending is None:
        return True
    mine = _pending.done.is_set()
    if all(_pending.coord.gather("checkpoint poll", lambda: mine)):
        finish()
        return True
    return False


def finish(timeout_s: float | None = None) -> Path | None:
    """Collective: wait for this rank's writer, agree, commit the pending async save ([Note: async checkpoint
    commit]); its directory, or None when none was pending. A failed or timed-out write raises on every
    rank and leaves `newest` at the previous checkpoint."""
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return None
    limit = WRITE_TIMEOUT_S if timeout_s is None else timeout_s
    job, coord = pending.job, pending.coord
    try:
        pending.done.wait(limit)

        def outcome() -> dict[str, Any]:
            if not pending.done.is_set():
                raise TimeoutError(
                    f"the checkpoint writer of tag {job.tag!r} was still writing after {limit:.0f} s (timeout_s / "
                    "shardpar.checkpoint.async_save.WRITE_TIMEOUT_S); the save is abandoned and `newest` stays at "
                    "the previous checkpoint: check the storage under the checkpoint path, or raise the timeout"
                )
            if pending.error is not None:
                raise pending.error
            return pending.report

        job.reports = coord.gather("save_checkpoint(async_save=True): writing shards", outcome)
        return Path(coord.on_root("save_checkpoint(async_save=True): committing", job.commit))
    except BaseException:
        if coord.is_root and job.tmp.exists():
            atomic.remove_dir(job.tmp)
        raise
    finally:
        for t in pending.held:  # after the directory was published or removed: never swept while in flight
            t.release()


def abandon_local(timeout_s: float = 60.0) -> str | None:
    """Not collective (smp.shutdown, an exit path where other ranks may be gone): wait up to `timeout_s`
    for this rank's writer and drop the pending save uncommitted; its tag, or None. The `.tmp-*` directory
    it leaves is swept by the next save or resume; `newest` names the previous checkpoint."""
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return None
    pending.done.wait(timeout_s)
    for t in pending.held:
        t.release()
    return pending.job.tag
