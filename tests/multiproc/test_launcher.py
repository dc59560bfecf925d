"""launch_local stops the whole launch when a rank fails or exits without a result, even if another rank
ignores SIGTERM."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardpar.cli import launcher
from shardpar.cli.launcher import LaunchError, launch_local
from tests.harness import process_context


@pytest.fixture(autouse=True)
def _ranks_from_the_fork_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """launch_local's ranks start as forks of the suite's fork server ([Note: forkserver ranks],
    tests/harness.py) instead of by spawn: these tests are about how a launch stops its ranks, not how
    they start (targets and results are pickled the same way; test_demo starts them by spawn, as a
    user's launch does). Saves a fresh interpreter importing torch per rank."""
    monkeypatch.setattr(launcher, "mp", SimpleNamespace(get_context=lambda _method: process_context()))


def _fail_while_a_peer_ignores_sigterm(ready: str) -> None:
    """Rank 1 ignores SIGTERM and sleeps; rank 0 fails once rank 1 is known to ignore it."""
    if int(os.environ["RANK"]) == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        Path(ready).write_text(str(os.getpid()))
        time.sleep(600)
        return
    deadline = time.monotonic() + 120
    while not Path(ready).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    raise RuntimeError("rank 0 fails on purpose")


def test_a_rank_that_ignores_sigterm_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # SIGKILL follows SIGTERM after the grace; how long the grace is proves nothing here.
    monkeypatch.setattr(launcher, "_TERMINATE_GRACE_S", 0.5)
    ready = tmp_path / "rank1.pid"
    outcome: list[BaseException] = []

    def launch() -> None:
        try:
            launch_local(_fail_while_a_peer_ignores_sigterm, 2, str(ready), timeout_s=300)
        except BaseException as e:  # handed to the test thread
            outcome.append(e)

    thread = threading.Thread(target=launch, daemon=True)
    thread.start()
    thread.join(timeout=60)
    if thread.is_alive():  # the launcher is stuck waiting on rank 1: clean up, then fail
        if ready.exists():
            os.kill(int(ready.read_text()), signal.SIGKILL)
        thread.join(timeout=30)
        pytest.fail("launch_local waited forever on a rank that ignores SIGTERM")
    assert len(outcome) == 1 and isinstance(outcome[0], LaunchError), outcome
    assert "rank 0 fails on purpose" in str(outcome[0])
    with pytest.raises(ProcessLookupError):
        os.kill(int(ready.read_text()), 0)  # rank 1 is gone


def _return_a_lock() -> threading.Lock:
    return threading.Lock()


def test_a_result_that_cannot_be_pickled_fails_at_once() -> None:
    # Before, the queue's feeder thread dropped the pickling error, the rank exited 0 without a
    # result, and the launcher waited out its whole timeout. The message tells the two apart: waiting
    # out the timeout raises "did not finish in 60 s" (no clock read here).
    with pytest.raises(LaunchError, match=r"rank 0 failed:\nits return value \(lock\) cannot be pickled \(TypeError"):
        launch_local(_return_a_lock, 1, timeout_s=60)


def _exit_quietly_while_a_peer_waits(pid_file: str) -> None:
    """Rank 1 ends its process with code 0 and no result; rank 0 would wait for ten minutes."""
    if int(os.environ["RANK"]) == 1:
        os._exit(0)
    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(600)


def test_a_rank_that_exits_0_without_a_result_fails_at_once(tmp_path: Path) -> None:
    # Before, exit code 0 counted as alive: the launcher waited out its whole timeout (3600 s by default)
    # and said "did not finish in 60 s"; the message is what shows it did not (no clock read here).
    pid_file = tmp_path / "rank0.pid"
    with pytest.raises(LaunchError, match=r"rank 1 exited \(code 0\) without returning a result"):
        launch_local(_exit_quietly_while_a_peer_waits, 2, str(pid_file), timeout_s=60)
    if pid_file.exists():  # rank 0 got as far as waiting: it was stopped, not left behind
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)
