"""SmddpWork: the backstop deadline of a step queued on the smddp engine's worker."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from shardpar.collectives import Group
from shardpar.collectives.smddp import SmddpWork

SHARDING = Group("sharding", (0, 1), None)


def test_the_default_wait_outlasts_the_transports_own_timeout() -> None:
    # A step that takes longer than the engine's timeout (queued behind others, or waiting on a peer
    # that the transport will name) is not cut off at that timeout: the transport's error, naming
    # the missing peer, must be the one that reaches the caller.
    future: Future[None] = Future()
    threading.Timer(0.3, future.set_result, args=(None,)).start()
    SmddpWork(future, timeout_s=0.1, op="all_reduce", group=SHARDING).wait()
    assert future.done()


def test_a_stuck_step_names_itself_and_the_knob() -> None:
    future: Future[None] = Future()
    work = SmddpWork(future, timeout_s=300, op="all_reduce", group=SHARDING)
    named = r"smddp all_reduce on sharding group \[0, 1\] did not finish within 0\.05 s"
    with pytest.raises(TimeoutError, match=named):
        work.wait(timeout=0.05)
    with pytest.raises(TimeoutError, match=r"collective_timeout_s=300\); look for an earlier error on another rank"):
        work.wait(timeout=0.05)


def test_the_steps_own_error_is_raised() -> None:
    future: Future[None] = Future()
    future.set_exception(RuntimeError("shm all_reduce: rank 1 (local index) did not arrive within 300 s"))
    with pytest.raises(RuntimeError, match=r"rank 1 .* did not arrive"):
        SmddpWork(future, timeout_s=300).wait()
