"""Automatic resume (issue 32 item 4): the causal-LM recipe under `torchrun --max-restarts 1`, world 2,
in-memory snapshots every 2 steps; rank 1 is killed with SIGKILL as it starts step 6. torchrun stops
rank 0 and starts both again; the restarted run finds the step-4 snapshot in /dev/shm by itself (no
--resume), and the run's losses, step by step, are exactly those of an uninterrupted run (fp32). A
normal finish leaves nothing in /dev/shm; the test removes what a failure left and every process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.causal_lm.options import Options
from recipes.causal_lm.report import read_metrics
from recipes.causal_lm.train import run
from shardpar.checkpoint import snapshot

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "multiproc" / "scripts" / "killed_recipe.py"
STEPS = 8
FLAGS = {
    "size": "tiny", "sdp": 2, "batch": 2, "seq": 32, "steps": STEPS, "lr": 3e-3, "warmup": 2,
    "snapshot_every": 2, "export": False, "sample_tokens": 0, "preemption": False, "progress": "lines",
}  # fmt: skip
KNOBS = {"sdp_param_persistence_threshold": 1000, "collective_timeout_s": 60}


def _argv(out: Path) -> list[str]:
    argv = [f"--out={out}"]
    for key, value in FLAGS.items():
        flag = "--" + key.replace("_", "-")
        if value is False:
            argv.append({"export": "--no-export", "preemption": "--no-preemption"}[key])
        else:
            argv.append(f"{flag}={value}")
    return argv + [f"--smp={k}={v}" for k, v in KNOBS.items()]


@pytest.mark.slow
def test_a_rank_killed_mid_run_is_restarted_and_resumes_from_memory_exactly(ranks, tmp_path: Path) -> None:
    straight = ranks.run(2, run, Options(out=str(tmp_path / "straight"), smp=KNOBS, **FLAGS), timeout=300)[0]
    assert straight.steps == list(range(1, STEPS + 1))

    out = tmp_path / "killed"
    shm = snapshot.snapshot_dir("/dev/shm", snapshot.job_key(out / "checkpoints", None))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SHARDPAR_TEST_KILL_RANK": "1", "SHARDPAR_TEST_KILL_STEP": "6"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
        "--monitor-interval=0.2", str(SCRIPT), *_argv(out),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the agent and its workers: one session
            proc.wait(timeout=30)
        leftover = shm.exists()
        shutil.rmtree(shm, ignore_errors=True)
    assert proc.returncode == 0, log[-4000:]
    assert "restarted: resumed from memory snapshot of step 4 at step 4" in log, log[-4000:]
    assert not leftover, f"{shm} was left behind after a normal finish"
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl")]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, STEPS + 1))
    assert losses == straight.losses, (losses, straight.losses)  # exact: the restart repeats nothing differently
