"""Cases for test_async_checkpoint.py (async saves, preemption), run on every rank of a pool.

Training is checkpoint_cases' recipe (UnevenMLP, AdamW, LambdaLR, a fixed global batch), so a resumed
run can be compared with a straight one.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import shardpar as smp
from shardpar.checkpoint import async_save
from tests import models
from tests.multiproc.checkpoint_cases import _build, _resume, _save, _train

HOLD_TIMEOUT_S = 60.0  # a held writer is released by the test well before; never waits forever


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _index(directory: Path) -> dict[str, Any]:
    import json

    return json.loads((directory / "index.json").read_text())


def async_equals_sync_case(root: str) -> dict[str, Any]:
    """World 4 / sdp 2: save synchronously and asynchronously at the same point; the async writer is held
    while 3 more steps train (mutating the saved tensors in place); then released and committed."""
    model, opt, sched = _build(sdp=2)
    _train(model, opt, sched, range(2))
    sync_dir = _save(os.path.join(root, "sync"), "s", model, opt, user_content={"step": 2})
    release = threading.Event()
    started = threading.Event()

    def hold(tag: str) -> None:
        started.set()
        if not release.wait(HOLD_TIMEOUT_S):
            raise TimeoutError("the test never released the writer")

    async_save.before_write = hold
    try:
        async_dir = _save(os.path.join(root, "async"), "s", model, opt, user_content={"step": 2}, async_save=True)
        steps_while_held = 0
        for step in range(2, 5):
            _train(model, opt, sched, range(step, step + 1))
            steps_while_held += 1
        held_newest = (Path(root) / "async" / "newest").exists()
        written_while_held = async_dir.exists()
        polled_while_held = smp.poll_checkpoint()  # every writer still held: nothing committed
        release.set()
        committed = smp.wait_for_checkpoint()
    finally:
        async_save.before_write = None
        release.set()
    return {
        "started": started.is_set(),
        "steps_while_held": steps_while_held,
        "held_newest": held_newest,
        "written_while_held": written_while_held,
        "polled_while_held": polled_while_held,
        "committed": committed,
        "newest": (Path(root) / "async" / "newest").read_text(),
        "sync": _files(sync_dir),
        "async": _files(async_dir),
        "sync_index": _index(sync_dir),
        "async_index": _index(async_dir),
        "staging_bytes": async_save.staging_bytes(),
        "leftovers": sorted(p.name for p in (Path(root) / "async").iterdir() if p.name.startswith(".")),
    }


def async_failure_and_keep_case(root: str) -> dict[str, Any]:
    """A writer failing on rank 1 leaves `newest` at the previous save; then async saves with keep-2,
    committed by a poll after each step, prune as synchronous ones do, and the newest resumes."""
    model, opt, sched = _build(sdp=2)
    _train(model, opt, sched, range(1))
    _save(root, "a", model, opt)

    def fail_on_rank_1(tag: str) -> None:
        if smp.rank() == 1:
            raise OSError(f"simulated: disk full while writing {tag}")

    async_save.before_write = fail_on_rank_1
    error = ""
    try:
        _save(root, "b", model, opt, async_save=True)
        _train(model, opt, sched, range(1, 2))
        try:
            smp.wait_for_checkpoint()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    finally:
        async_save.before_write = None
    staging_error = ""
    stage = async_save._staging.stage
    if smp.rank() == 1:  # staging fails on one rank: the call returns there too, the commit raises everywhere

        def refuse(tensors: Any, ready: Any = None) -> Any:
            raise RuntimeError("simulated: no pinned memory left")

        async_save._staging.stage = refuse  # type: ignore[method-assign]
    try:
        _save(root, "c", model, opt, async_save=True)
        try:
            smp.wait_for_checkpoint()
        except Exception as e:
            staging_error = f"{type(e).__name__}: {e}"
    finally:
        async_save._staging.stage = stage  # type: ignore[method-assign]
    smp.barrier()  # rank 0 removes the failed save's directory as it raises; list after it did
    after_failure = {
        "newest": (Path(root) / "newest").read_text(),
        "listing": sorted(p.name for p in Path(root).iterdir()),
    }
    smp.barrier()  # every rank listed before rank 0 starts the next save
    polls = 0
    for i, step in enumerate(range(2, 5)):
        _save(root, f"k{i}", model, opt, user_content={"step": step}, num_kept_partial_checkpoints=2, async_save=True)
        _train(model, opt, sched, range(step, step + 1))
        while not smp.poll_checkpoint():  # the writers are quick; a bounded spin keeps the test step-based
            polls += 1
            if polls > 10_000:
                raise TimeoutError("async writers never finished")
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    _save(root, "last", model, opt, user_content={"step": 5}, num_kept_partial_checkpoints=2, async_save=True)
    _train(model, opt, sched, range(5, 6))
    content = _resume(root, None, model, opt)  # commits "last" first, then loads it
    resumed = model.state_dict()
    return {
        "error": error,
        "staging_error": staging_error,
        "after_failure": after_failure,
        "listing": sorted(p.name for p in Path(root).iterdir()),
        "newest": (Path(root) / "newest").read_text(),
        "content": content,
        "resumed_diff": max((resumed[k] - at_save[k]).abs().max().item() for k in at_save),
    }


def preempted_case(root: str, signal_rank: int | None, steps: int) -> dict[str, Any]:
    """Train `steps` steps with preemption handling; `signal_rank` sends itself a real SIGTERM in the
    middle of step 3. Every rank checks at each step boundary; on preemption all save and exit."""
    resuming = (Path(root) / "newest").exists()
    model, opt, sched = _build(sdp=2, seed=123 if resuming else 0)  # a resume must load, not rebuild, the state
    smp.handle_preemption()
    start, losses, lines = 0, [], []
    try:
        if resuming:
            content = _resume(root, None, model, opt)
            start = int(content["step"])
            sched.load_state_dict(content["scheduler"])
        for step in range(start, steps):
            if step == 2 and smp.rank() == signal_rank:
                os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-step on this rank only
            losses += _train(model, opt, sched, range(step, step + 1))
            if smp.preemption_requested():
                content = {"step": step + 1, "scheduler": sched.state_dict()}
                _save(root, f"step{step + 1}", model, opt, user_content=content, async_save=True)
                path = smp.wait_for_checkpoint()
                try:
                    smp.exit_preempted(path, step + 1, say=lines.append)
                except SystemExit as e:
                    return {"losses": losses, "code": e.code, "lines": lines, "stopped_after": step + 1}
    finally:
        smp.stop_handling_preemption()
    return {"losses": losses, "code": None, "lines": lines, "stopped_after": steps, "start": start}


def recipe_preempted_case(opts: Any, signal_rank: int, at_step: int) -> dict[str, Any]:
    """recipes/causal_lm's run() with a real SIGTERM sent by `signal_rank` to itself during step `at_step`
    (from inside its training step); the recipe's SystemExit is caught here (a pool worker must live on)."""
    from recipes.causal_lm import train

    original, calls = train._train_step, []

    def step_then_signal(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == at_step and smp.rank() == signal_rank:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    train._train_step = step_then_signal  # type: ignore[assignment]
    try:
        train.run(opts)
    except SystemExit as e:
        return {"code": e.code, "steps": len(calls)}
    finally:
        train._train_step = original  # type: ignore[assignment]
    return {"code": None, "steps": len(calls)}


def trainer_preempted_case(out: str) -> dict[str, Any]:
    """World 2, shardpar's Trainer: (a) 4 steps straight; (b) a real SIGTERM to rank 1 in step 2, caught
    SystemExit; (c) resume_from_checkpoint=True of (b) to step 4."""
    from transformers import TrainerCallback

    from shardpar.integrations.transformers import Trainer
    from tests.multiproc import trainer_cases as tc

    steps, world = 4, int(os.environ["WORLD_SIZE"])

    class SignalRank1(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 1 and smp.rank() == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    def trainer(directory: str, *callbacks: Any) -> Any:
        return Trainer(
            model=models.tiny_neox(0),
            args=tc.training_args(f"{out}/{directory}", world, max_steps=steps),
            train_dataset=tc.TokenDataset(steps * tc.ACCUM * tc.GLOBAL_BATCH, 0),
            callbacks=list(callbacks),
            shardpar_config=tc.SHARD,
        )

    straight = trainer("a")
    straight.train()
    result: dict[str, Any] = {"straight": tc._history(straight)["loss"]}
    smp.shutdown()
    stopped = trainer("b", SignalRank1())
    try:
        stopped.train()
        result["code"] = None
    except SystemExit as e:
        result["code"] = e.code
    result["stopped"] = tc._history(stopped)["loss"]
    result["listing"] = sorted(p.name for p in Path(f"{out}/b").iterdir())
    smp.shutdown()
    if int(os.environ["RANK"]) == 0:  # (d) restarts from the same stopped run; it starts after (c)'s collectives
        shutil.copytree(f"{out}/b", f"{out}/c")
    resumed = trainer("b")
    resumed.train(resume_from_checkpoint=True)
    result["resumed"] = tc._history(resumed)["loss"]
    smp.shutdown()
    # (d) what torchrun --max-restarts does after a failure: the same script again, no resume argument
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
    try:
        restarted = trainer("c")
        restarted.train()
        result["restarted"] = tc._history(restarted)["loss"]
    finally:
        del os.environ["TORCHELASTIC_RESTART_COUNT"]
    return result
