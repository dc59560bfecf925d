"""The failure board ([Note: first failure], shardpar/collectives/failures.py): which rank failed first,
agreed through the store. One store stands for the job; boards of several "ranks" share it."""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from shardpar.collectives import failures
from shardpar.collectives.failures import FailureBoard, culprit_message


@pytest.fixture
def store() -> dist.Store:
    s = dist.HashStore()
    s.set_timeout(datetime.timedelta(seconds=5))
    return s


class _Clock:
    """failures.time for a test: monotonic() is the sum of the sleeps so far, and the sleeps are
    counted, so a wait is judged by its polls and its simulated length, never by a real clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(failures, "time", fake)
    return fake


@pytest.fixture(autouse=True)
def _keep_excepthook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # boards install theirs: undo it after the test
    monkeypatch.setattr(failures, "_HOOKED", [])


def test_the_first_post_wins_for_every_reader_even_across_process_groups(store: dist.Store) -> None:
    # Boards made on two groups' prefixed stores share the job's record.
    a, b = FailureBoard(dist.PrefixStore("pg1/", store), 1), FailureBoard(dist.PrefixStore("pg2/", store), 3)
    b.post(2, "shm all_reduce: global rank 2 died")
    a.post(3, "shm all_reduce: global rank 3 died")  # a secondary casualty, reported later
    for board in (a, b):
        first = board.first()
        assert first is not None and (first.rank, first.reporter) == (2, 3), first
        assert first.reason == "shm all_reduce: global rank 2 died"


def test_a_rank_stuck_behind_a_stuck_rank_names_the_one_that_never_arrived(store: dist.Store) -> None:
    # Rank 2 hangs outside any collective; rank 3 waits for it in {2, 3}; ranks 0 and 1 wait for
    # rank 3 in {0, 1, 3}. The transport of rank 0 names rank 3: the board must name rank 2.
    boards = {r: FailureBoard(store, r) for r in (0, 1, 3)}
    groups = {0: (0, 1, 3), 1: (0, 1, 3), 3: (2, 3)}
    found: dict[int, list[int]] = {}

    def timed_out(rank: int) -> None:
        found[rank] = boards[rank].missing_after_timeout(groups[rank], settle_s=0.5)

    threads = [threading.Thread(target=timed_out, args=(r,)) for r in (3, 0, 1)]
    for t in threads:
        t.start()
        time.sleep(0.05)  # they time out at about the same time, not at once
    for t in threads:
        t.join(10)
    assert found == {0: [2], 1: [2], 3: [2]}


def test_ranks_all_stuck_somewhere_name_nobody(store: dist.Store, clock: _Clock) -> None:
    boards = [FailureBoard(store, r) for r in range(2)]
    boards[1].missing_after_timeout((0, 1), settle_s=0.0)
    assert boards[0].missing_after_timeout((0, 1), settle_s=5.0) == []
    assert clock.sleeps == 0  # no need to wait out the settle time: everyone had checked in


def test_a_dead_member_on_this_host_is_found_by_its_pid(store: dist.Store) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        FailureBoard(store, 1)  # posts this process's pid as rank 1's...
        store.set("shardpar/failure/0/proc/1", f"{failures.host_id()}|{child.pid}")  # ...the child's instead
        me = FailureBoard(store, 0)
        assert me.dead_members((0, 1)) == []
        child.kill()
        time.sleep(0.2)  # not reaped yet: a zombie counts as dead
        assert me.dead_members((0, 1)) == [1]
    finally:
        child.kill()
        child.wait()


def test_culprit_messages(store: dist.Store) -> None:
    first, second = FailureBoard(store, 3), FailureBoard(store, 0)
    message, culprit = culprit_message(
        first, "shm all_reduce: global rank 2 died", ranks=(2, 3), culprit=2, timed_out=False
    )
    assert (message, culprit) == ("rank 2 failed first: shm all_reduce: global rank 2 died", 2)
    local = "native all_reduce on world group [0, 1, 3] failed: Connection closed by peer [127.0.0.1]:1234"
    message, culprit = culprit_message(second, local, ranks=(0, 1, 3), culprit=None, timed_out=False)
    assert culprit == 2 and message == (
        f"{local}; rank 2 failed first: shm all_reduce: global rank 2 died (reported by rank 3)"
    )


def test_nothing_posted_says_so_after_a_bounded_wait(
    store: dist.Store, monkeypatch: pytest.MonkeyPatch, clock: _Clock
) -> None:
    monkeypatch.setattr(failures, "SETTLE_S", 0.2)
    message, culprit = culprit_message(FailureBoard(store, 0), "boom", ranks=(0, 1), culprit=None, timed_out=False)
    assert culprit is None and message == "boom; no rank posted a failure to the job's store"
    # It waited for a post (2 x SETTLE_S), polling, and then stopped: a bounded number of polls.
    assert 0.4 <= clock.now <= 0.4 + failures._POLL_S + 1e-9, clock.now
    assert clock.sleeps <= round(0.4 / failures._POLL_S) + 1, clock.sleeps


def test_an_unreachable_store_adds_nothing_and_never_blocks() -> None:
    class Gone:
        def __getattr__(self, name: str) -> object:
            def fail(*args: object) -> None:
                raise RuntimeError("Connection reset by peer")

            return fail

    board = FailureBoard(Gone(), 0)
    board.post(1, "x")
    assert board.first() is None and board.dead_members((0, 1)) == []
    message, culprit = culprit_message(board, "rank 1 died", ranks=(0, 1), culprit=1, timed_out=False)
    assert (message, culprit) == ("rank 1 failed first, as far as rank 0 can tell (no store): rank 1 died", 1)


def test_an_uncaught_exception_posts_its_rank_or_the_culprit_it_names(store: dist.Store) -> None:
    board = FailureBoard(store, 1)
    try:
        raise ValueError("bad batch")
    except ValueError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    first = board.first()
    assert first is not None and (first.rank, first.reason) == (1, "raised ValueError: bad batch")

    other = dist.HashStore()
    board = FailureBoard(other, 1)
    named = failures.CollectiveError("rank 2 failed first: died", culprit=2)
    sys.excepthook(type(named), named, None)
    first = board.first()
    assert first is not None and first.rank == 2


def test_a_member_whose_pid_goes_only_after_the_error_is_still_named(
    store: dist.Store, monkeypatch: pytest.MonkeyPatch, clock: _Clock
) -> None:
    # Rank 1's connection closed, but its pid still looks alive at the first look: the board keeps
    # looking (with the wait for another rank's post) instead of giving up on the dead-member check.
    looks = []

    def alive(pid: int) -> bool:
        looks.append(pid)
        return len(looks) <= 3

    FailureBoard(store, 1)  # posts this process's pid as rank 1's
    monkeypatch.setattr(failures, "pid_alive", alive)
    board, reads = FailureBoard(store, 0), []
    read = board._read

    def counted(name: str) -> str | None:
        reads.append(name)
        return read(name)

    monkeypatch.setattr(board, "_read", counted)
    local = "native all_reduce on test group [0, 1] failed: Connection closed by peer [127.0.0.1]:1234"
    message, culprit = culprit_message(board, local, ranks=(0, 1), culprit=None, timed_out=False)
    assert culprit == 1 and message == f"rank 1 failed first: its process is gone ({local})", message
    assert len(looks) == 4 and clock.sleeps == 3
    assert reads.count("proc/1") == 1, reads  # the pid is read from the store once, then only looked at
