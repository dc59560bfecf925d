"""Cases for test_async_stage.py: an async save copies this rank's tensors on the writer thread, and every
official write of the main values or optimizer state waits for that copy ([Note: background staging] in
checkpoint/async_save.py, [Note: writes wait for staging] in runtime/write_guard.py).

The staging copy is held on a gate (async_save.before_stage) that only a write's wait opens
(async_save.on_stage_wait): a write that did not wait would run before the copy, and the checkpoint
would hold its values instead of the ones at the call. No timing is measured; a gate never opened
fails the save after HOLD_TIMEOUT_S instead of hanging the suite.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import shardpar as smp
from shardpar.checkpoint import async_save
from tests import models
from tests.multiproc.checkpoint_cases import GLOBAL_BATCH, _build, _save, _train

HOLD_TIMEOUT_S = 60.0


def _files(directory: Path) -> dict[str, bytes]:
    """The checkpoint's tensor files with its checkpoint id blanked (a hex uuid: the same length)."""
    import json

    cid = json.loads((directory / "index.json").read_text())["checkpoint_id"].encode()
    return {p.name: p.read_bytes().replace(cid, b"0" * len(cid)) for p in sorted(directory.glob("*.safetensors"))}


@contextmanager
def _gated() -> Iterator[dict[str, Any]]:
    """Hold every staging copy until a write waits for it; record what waited."""
    gate = threading.Event()
    seen: dict[str, Any] = {"waited": [], "opened_by_wait": False}

    def hold(tag: str) -> None:
        if not gate.wait(HOLD_TIMEOUT_S):
            raise TimeoutError(f"the staging of {tag} was never released by a waiting write")

    def release(what: str) -> None:
        seen["waited"].append(what)
        seen["opened_by_wait"] = seen["opened_by_wait"] or not gate.is_set()
        gate.set()

    async_save.before_stage, async_save.on_stage_wait = hold, release
    try:
        yield seen
    finally:
        async_save.before_stage = async_save.on_stage_wait = None
        gate.set()


def _forward_backward(model: Any, step: int) -> None:
    r, n = smp.rdp_rank(), smp.rdp_size()
    per = GLOBAL_BATCH // n
    batch = models.mlp_batch(1000 + step, GLOBAL_BATCH)
    model.backward(model(**{k: v[r * per : (r + 1) * per] for k, v in batch.items()}))


def step_after_save_case(root: str) -> dict[str, Any]:
    """Save sync and async at the same point; the async copy is held while forward, backward and a
    user's clip run, then the optimizer step waits for it and releases it."""
    model, opt, sched = _build(sdp=2)
    _train(model, opt, sched, range(2))
    sync_dir = _save(os.path.join(root, "sync"), "s", model, opt)
    with _gated() as seen:
        async_dir = _save(os.path.join(root, "async"), "s", model, opt, async_save=True)
        staged_at_return = async_save.staged()  # the call returned with the copy not yet run
        _forward_backward(model, 2)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # writes gradients only: no wait
        waits_before_step = async_save.stage_waits()
        staged_before_step = async_save.staged()
        opt.step()
        waits_after_step = async_save.stage_waits()
        opt.zero_grad()
        committed = smp.wait_for_checkpoint()
    return {
        "staged_at_return": staged_at_return,
        "staged_before_step": staged_before_step,
        "waits_before_step": waits_before_step,
        "waits_after_step": waits_after_step,
        "seen": seen,
        "committed": str(committed),
        "sync": _files(sync_dir),
        "async": _files(async_dir),
    }


def _writers(model: Any, opt: Any) -> list[tuple[str, Callable[[], None]]]:
    """(name, a write of the main values or optimizer state through an official path) -- every rank alike."""
    params = [p for p in model.parameters() if p.requires_grad]
    full = {k: v * 0.5 for k, v in model.state_dict().items()}  # a collective: taken before any save
    opt_state = opt.state_dict()

    def inplace() -> None:
        with torch.no_grad():
            params[0].mul_(2.0)

    def foreach() -> None:
        with torch.no_grad():
            torch._foreach_add_(params, 1.0)

    def assign_data() -> None:
        params[1].data = torch.zeros(params[1].shape)

    def plain_optimizer() -> None:  # a torch optimizer on model.parameters(): ShardedTensor's foreach ops
        _forward_backward(model, 7)  # runs while the copy is held
        torch.optim.SGD(params, lr=0.1).step()
        opt.zero_grad()

    return [
        ("p.mul_", inplace),
        ("_foreach_add_", foreach),
        ("p.data =", assign_data),
        ("model.load_state_dict", lambda: model.load_state_dict(full)),
        ("optimizer.load_state_dict", lambda: opt.load_state_dict(opt_state)),
        ("torch.optim.SGD on model.parameters()", plain_optimizer),
    ]


def writes_wait_case(root: str) -> dict[str, Any]:
    """For each official write: a sync save, an async save held at its copy, the write (which must wait
    and so release the copy), the commit; the two checkpoints hold the same bytes."""
    model, opt, sched = _build(sdp=2)
    _train(model, opt, sched, range(1))
    out: dict[str, Any] = {}
    for i, (name, write) in enumerate(_writers(model, opt)):
        sync_dir = _save(os.path.join(root, "sync"), f"w{i}", model, opt)
        with _gated() as seen:
            async_dir = _save(os.path.join(root, "async"), f"w{i}", model, opt, async_save=True)
            write()
            smp.wait_for_checkpoint()
        out[name] = {"seen": seen, "same": _files(sync_dir) == _files(async_dir), "files": len(_files(sync_dir))}
    return out


def stage_timeout_case(root: str) -> dict[str, Any]:
    """A staging copy that never finishes: the step raises (bounded) naming the save and the knob; once
    released, the save commits and training goes on."""
    model, opt, sched = _build(sdp=2)
    _train(model, opt, sched, range(1))
    gate = threading.Event()
    saved_limit = async_save.STAGE_TIMEOUT_S
    async_save.before_stage = lambda tag: gate.wait(HOLD_TIMEOUT_S) and None  # released below, after the step
    async_save.STAGE_TIMEOUT_S = 0.2
    error = ""
    try:
        _save(root, "t", model, opt, async_save=True)
        _forward_backward(model, 1)
        try:
            opt.step()
        except TimeoutError as e:
            error = str(e)
    finally:
        async_save.before_stage = None
        async_save.STAGE_TIMEOUT_S = saved_limit
        gate.set()
    committed = smp.wait_for_checkpoint()
    opt.zero_grad()
    losses = _train(model, opt, sched, range(1, 2))
    died, lost = _writer_died(root, model, opt)
    return {"error": error, "committed": str(committed), "losses": losses, "died": died, "lost": lost}


def _writer_died(root: str, model: Any, opt: Any) -> tuple[str, str]:
    """A writer thread gone without ending its copy (killed from outside: simulated by a dead thread in
    its place): the step raises at once, naming the save; the commit fails on every rank."""
    gate = threading.Event()
    async_save.before_stage = lambda tag: gate.wait(HOLD_TIMEOUT_S) and None
    died = lost = ""
    try:
        _save(root, "d", model, opt, async_save=True)
        pending = async_save._pending
        assert pending is not None and pending.thread is not None
        real, dead = pending.thread, threading.Thread(target=lambda: None)
        dead.start()
        dead.join()
        pending.thread = dead
        _forward_backward(model, 2)
        try:
            opt.step()
        except RuntimeError as e:
            died = str(e)
        gate.set()
        idle = threading.Event()  # the real copy and write run on (their outcome is not reported): the
        writer = async_save._the_writer  # writer runs jobs in order, so this one runs after them
        assert writer is not None and writer.thread is real
        writer.submit(idle.set)
        idle.wait(HOLD_TIMEOUT_S)
        try:
            smp.wait_for_checkpoint()
        except Exception as e:
            lost = f"{type(e).__name__}: {e}"
    finally:
        async_save.before_stage = None
        gate.set()
    opt.zero_grad()
    return died, lost
