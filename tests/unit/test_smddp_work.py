"""FutureWork: the backstop deadline of a step queued on the smddp engine's worker, and the step's own
error, which must reach the caller (with the rank that failed first, when the engine explains it)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from shardpar.collectives import Group, shm
from shardpar.collectives.base import FutureWork

SHARDING = Group("sharding", (0, 1), None)


def test_the_default_wait_outlasts_the_transports_own_timeout() -> None:
    # A step that takes longer than the engine's timeout (queued behind others, or waiting on a peer
    # that the transport will name) is not cut off at that timeout: the transport's error, naming
    # the missing peer, must be the one that reaches the caller.
    future: Future[None] = Future()
    threading.Timer(0.3, future.set_result, args=(None,)).start()
    FutureWork(future, timeout_s=0.1, op="all_reduce", group=SHARDING).wait()
    assert future.done()


def test_a_stuck_step_names_itself_and_the_knob() -> None:
    future: Future[None] = Future()
    work = FutureWork(future, timeout_s=300, op="all_reduce", group=SHARDING)
    named = r"smddp all_reduce on sharding group \[0, 1\] did not finish within 0\.05 s"
    with pytest.raises(TimeoutError, match=named):
        work.wait(timeout=0.05)
    with pytest.raises(TimeoutError, match=r"collective_timeout_s=300\); look for an earlier error on another rank"):
        work.wait(timeout=0.05)


def test_the_steps_own_error_is_raised() -> None:
    future: Future[None] = Future()
    future.set_exception(RuntimeError("shm all_reduce: rank 1 (local index) did not arrive within 300 s"))
    with pytest.raises(RuntimeError, match=r"rank 1 .* did not arrive"):
        FutureWork(future, timeout_s=300).wait()


def test_the_transports_timeout_is_not_taken_for_the_backstop() -> None:
    # ShmTimeoutError is a TimeoutError, and on Python >= 3.11 so is concurrent.futures' timeout: the
    # wait caught the step's error as its own backstop and replaced "global rank 2 did not arrive
    # within 20 s" with "did not finish within 50 s of waiting".
    future: Future[None] = Future()
    future.set_exception(
        shm.ShmTimeoutError("shm all_reduce: global rank 2 (local index 2) did not arrive within 20 s")
    )
    with pytest.raises(shm.ShmTimeoutError, match=r"global rank 2 \(local index 2\) did not arrive within 20 s"):
        FutureWork(future, timeout_s=20, op="all_reduce", group=SHARDING).wait()


def test_an_explained_error_keeps_the_steps_error_as_its_cause() -> None:
    future: Future[None] = Future()
    original = shm.ShmPeerError("shm all_reduce: global rank 3 (local index 1, pid 7) died", 3)
    future.set_exception(original)
    seen: list[tuple[BaseException, bool]] = []

    def explain(error: BaseException, timed_out: bool) -> BaseException:
        seen.append((error, timed_out))
        return shm.ShmPeerError(f"{error}; rank 2 failed first: died", 2)

    with pytest.raises(shm.ShmPeerError, match="rank 2 failed first") as caught:
        FutureWork(future, timeout_s=20, op="all_reduce", group=SHARDING, explain=explain).wait()
    assert caught.value.__cause__ is original and seen == [(original, False)]


def test_the_backstop_is_explained_as_a_timeout() -> None:
    seen: list[bool] = []

    def explain(error: BaseException, timed_out: bool) -> BaseException:
        seen.append(timed_out)
        return error

    with pytest.raises(TimeoutError, match=r"did not finish within 0\.05 s"):
        FutureWork(Future(), timeout_s=300, op="all_reduce", group=SHARDING, explain=explain).wait(timeout=0.05)
    assert seen == [True]
