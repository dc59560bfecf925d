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
(pinned when the source is on CUDA) that are kept and reused by the next save of the same layout. The
writer reads only the staging buffers, and the next save reuses them only after the previous write
finished.

[Note: background staging]
The call itself copies nothing big, as torch DCP's AsyncStager with `block_on_staging=False`: it takes
what is cheap or would change under the next forward -- the scalars of the optimizer state, the RNG
states, the index's model-side entries, clones of the buffers (a BatchNorm's running statistics move
in forward) -- and hands views of the main shards and the optimizer's per-element state to the writer
thread, which copies them into the staging buffers first (torch's copies release the GIL; a CUDA
source copies on a side stream, after an event recorded on the training stream at the call) and then
writes. The next forward and backward read those tensors and write only gradients; whatever would
write them waits for the copy at runtime/write_guard.py ([Note: writes wait for staging]): the
optimizer step, loads, in-place ops on the parameters. The wait is bounded (STAGE_TIMEOUT_S) and
raises naming the save if the copy never completes. On 2 busy cores the copy competes with the
step for the CPU; it costs the same bytes as before, only no longer inside the call.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardpar.checkpoint import atomic
from shardpar.checkpoint import index as ix
from shardpar.checkpoint import partial as _partial
from shardpar.checkpoint.atomic import Coordinator
from shardpar.runtime import write_guard

# How long the commit waits for this rank's writer before it abandons the checkpoint (a hung filesystem):
# every wait has a bound. Generous: a slow disk writing gigabytes is not an error.
WRITE_TIMEOUT_S = 1800.0

# How long a write to the main values (an optimizer step, a load) waits for this rank's staging copy
# (a memory copy of this rank's file: seconds for gigabytes) before it raises.
STAGE_TIMEOUT_S = 600.0

# True: the call returns only after the staging copy, as before background staging (torch DCP's
# `block_on_staging=True`); benchmarks/bench_async_save.py measures both in one run.
BLOCK_ON_STAGING = False

_BUFFERS = ix.buffer_key("")  # the keys of rank 0's buffers in its file

# Test hook: called on the writer thread before the staging copy (a test holds it to prove that the call
# returns before the copy and that a step waits for it).
before_stage: Callable[[str], None] | None = None
# Test hook: called on the main thread when a write is about to wait for the staging copy.
on_stage_wait: Callable[[str], None] | None = None

# Test hook: called on the writer thread before it writes (a test holds it on an Event to prove that
# training goes on meanwhile, or raises to simulate a failing disk).
before_write: Callable[[str], None] | None = None


class Staging:
    """Host copies of this rank's tensors, one buffer per key, reused while key, dtype and shape repeat."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()  # the writer thread stages while the main thread may ask nbytes

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, tensors: dict[str, torch.Tensor], ready: Any = None) -> dict[str, torch.Tensor]:
        """Copy `tensors` into the kept buffers (in their order); a key no longer staged frees its buffer.
        `ready`: a CUDA event recorded on the training stream after the last write to the sources; the
        copies of CUDA sources run on a side stream after it, and this returns once they are done."""
        staged: dict[str, torch.Tensor] = {}
        device = next((t.device for t in tensors.values() if t.is_cuda), None)
        # this thread's current device is cuda:0 whatever the rank's is: name the sources' device
        side = torch.cuda.Stream(device=device) if device is not None else None
        if side is not None and ready is not None:
            side.wait_event(ready)
        with self._lock:
            for key, src in tensors.items():
                buf = self._buffers.get(key)
                if buf is None or buf.dtype != src.dtype or buf.shape != src.shape:
                    pin = src.is_cuda  # pinned: the device-to-host copy runs as one DMA
                    buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
                    self._buffers[key] = buf
                staged[key] = buf
        # One call for every copy: it holds the GIL once. A copy per tensor handed the GIL back and forth
        # with the training thread (torch releases it around each op) hundreds of times per save, which
        # on a loaded machine slowed the steps the copy overlaps far more than the copy itself costs.
        # no_grad: the sources are leaves that require grad, the buffers must not join any graph.
        with torch.no_grad(), torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if staged:  # a rank that writes nothing stages nothing
                torch._foreach_copy_(list(staged.values()), list(tensors.values()), non_blocking=side is not None)
        if side is not None:
            side.synchronize()  # the copies are complete before the writer reads them and writes may resume
        with self._lock:
            for key in [k for k in self._buffers if k not in staged]:
                del self._buffers[key]  # a layout that changed: do not keep memory nobody writes
        return staged


class _Writer:
    """One daemon thread per process that runs the saves' staging and writing, one at a time. Kept from
    the first async save to smp.shutdown: starting a thread per save cost the call a few ms on a loaded
    machine (Thread.start waits until the new thread runs), part of the stall this module is for."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="shardpar-ckpt-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()  # catches its own errors: they belong to its save

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def close(self, timeout_s: float) -> None:
        self._jobs.put(None)
        self.thread.join(timeout_s)


def _writer() -> _Writer:
    global _the_writer
    if _the_writer is None or not _the_writer.thread.is_alive():
        _the_writer = _Writer()
    return _the_writer


@dataclass
class _Pending:
    job: _partial.SaveJob
    coord: Coordinator
    held: list[atomic.TmpDir]
    report: dict[str, Any]
    thread: threading.Thread | None = None
    error: Exception | None = None
    staged: threading.Event = field(default_factory=threading.Event)  # the staging copy ended (or failed)
    done: threading.Event = field(default_factory=threading.Event)
    waits: int = 0  # writes that found the copy still running and waited for it


_pending: _Pending | None = None
_the_writer: _Writer | None = None
_waited_s = 0.0  # stage_wait_seconds()
_staging = Staging()


def staging_bytes() -> int:
    """Host bytes this process keeps for staging async saves (reused by every save of the same layout)."""
    return _staging.nbytes


def pending_tag() -> str | None:
    return _pending.job.tag if _pending is not None else None


def start(coord: Coordinator, job: _partial.SaveJob, held: list[atomic.TmpDir]) -> Path:
    """Take the cheap part of this rank's state, freeze the index's model-side entries, start the writer,
    which stages the tensors and then writes ([Note: background staging]); the final path.

    Local (no collective). The caller has waited for any previous async save (`finish`).
    """
    global _pending
    if _pending is not None:
        raise AssertionError("an async save is still pending: finish() it first")
    model, optimizer = job.model, job.optimizer
    sources: dict[str, torch.Tensor] = {}
    report: dict[str, Any] = {}

    # No agreement here (it would be one more collective in the stall): a rank whose staging fails keeps
    # the error, starts no writer, and the commit raises it on every rank like a failed write.
    pending = _Pending(job, coord, held, report)
    ready = None
    try:
        tensors, rep = _partial.collect_rank_file(model, optimizer)  # views; scalars and RNG taken now
        for key, t in tensors.items():  # file order kept
            # buffers may change in the next forward (running statistics) and pass no write gate: clone now
            sources[key] = t.detach().clone() if key.startswith(_BUFFERS) else t
        report.update(rep)
        if coord.is_root:
            job.freeze()  # lr, loss scaler, backward count as of this call, not as of the commit
        if any(t.is_cuda for t in sources.values()):
            ready = torch.cuda.Event()
            ready.record()  # after the last step's writes on the training stream: the side stream waits for it
    except Exception as e:
        pending.error = e
    rank = model.topology.coords.rank

    def write() -> None:
        staged: dict[str, torch.Tensor] | None = None
        try:
            try:
                if before_stage is not None:
                    before_stage(job.tag)
                staged = _staging.stage(sources, ready)
            finally:
                sources.clear()  # the views of the live tensors go: nothing here reads them any more
                pending.staged.set()  # a failed copy releases the writers too; the commit reports it
            if before_write is not None:
                before_write(job.tag)
            _partial.write_collected(job.tmp, job.checkpoint_id, rank, staged, report)
        except Exception as e:  # reported to every rank at the commit
            pending.error = e
        finally:
            pending.done.set()

    _pending = pending
    if pending.error is not None:
        pending.staged.set()
        pending.done.set()
        return job.final
    writer = _writer()
    pending.thread = writer.thread
    writer.submit(write)
    write_guard.set_waiter(functools.partial(_wait_staged, pending))
    if BLOCK_ON_STAGING:
        _wait_bounded(pending, "save_checkpoint(async_save=True)", STAGE_TIMEOUT_S, time.monotonic())
        write_guard.set_waiter(None)
    return job.final


def staged() -> bool:
    """Whether the pending async save (if any) finished copying this rank's tensors into staging."""
    return _pending is None or _pending.staged.is_set()


def stage_wait_seconds() -> float:
    """Seconds this process's writes spent waiting for staging copies, over all async saves (a benchmark
    adds them to the call's stall: the part of the copy that training did not hide)."""
    return _waited_s


def stage_waits() -> int:
    """How many writes waited for the pending async save's staging copy (0 when none is pending)."""
    return _pending.waits if _pending is not None else 0


def _wait_staged(pending: _Pending, what: str) -> None:
    """write_guard's waiter ([Note: writes wait for staging]): return once `pending`'s staging copy ended,
    so `what` may write the tensors it read; raise if it does not end within STAGE_TIMEOUT_S. Bound to the
    save, not to `_pending`: a commit that timed out leaves the copy running, and writes still wait."""
    if pending.staged.is_set():
        write_guard.set_waiter(None)  # later writes pay nothing until the next async save
        return
    pending.waits += 1
    if on_stage_wait is not None:
        on_stage_wait(what)
    limit, start = STAGE_TIMEOUT_S, time.monotonic()
    try:
        _wait_bounded(pending, what, limit, start)
    finally:
        global _waited_s
        _waited_s += time.monotonic() - start
    write_guard.set_waiter(None)


def _wait_bounded(pending: _Pending, what: str, limit: float, start: float) -> None:
    while not pending.staged.wait(min(1.0, limit)):
        thread = pending.thread
        if thread is not None and not thread.is_alive() and not pending.staged.is_set():
            # The writer marks the copy ended in a `finally`, so only a thread killed from outside gets here.
            # Nothing reads the tensors any more: later writes go on, and the save fails at its commit.
            error = RuntimeError(
                f"the checkpoint writer of tag {pending.job.tag!r} died before it finished copying this rank's "
                "tensors into staging; this save is lost (`newest` stays at the previous checkpoint)"
            )
            pending.error = error
            pending.staged.set()
            pending.done.set()
            raise RuntimeError(f"{what}: {error}; save again, smp.wait_for_checkpoint() reports it too") from None
        if time.monotonic() - start >= limit:
            raise TimeoutError(
                f"{what} waited {limit:.0f} s (shardpar.checkpoint.async_save.STAGE_TIMEOUT_S) for the async "
                f"checkpoint of tag {pending.job.tag!r} to copy this rank's tensors into staging; the copy is "
                "still running, so the write would change what it reads. Check the host's memory (swapping?) "
                "or raise STAGE_TIMEOUT_S; smp.wait_for_checkpoint() waits for the save and commits it"
            )


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
        if pending.staged.is_set():
            write_guard.set_waiter(None)  # else later writes still wait for the copy

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
    it leaves is swept by the next save or resume; `newest` names the previous checkpoint. Stops the writer
    thread (the next async save starts one)."""
    global _pending, _the_writer
    pending, _pending = _pending, None
    if pending is not None:
        pending.done.wait(timeout_s)
        if pending.staged.is_set():
            write_guard.set_waiter(None)
        for t in pending.held:
            t.release()
    if _the_writer is not None:  # idle now unless its write hangs: then the daemon thread is left behind
        _the_writer.close(1.0)
        _the_writer = None
    return pending.job.tag if pending is not None else None
