"""Naming the rank that failed first, on every survivor ([Note: first failure]).

# [Note: first failure]
# When one rank of a job dies or stops arriving, its peers fail one after the other, and each sees
# only its own neighbour: a survivor in another group names a rank that itself failed because of the
# first one (a "secondary casualty"), and gloo names nobody ("Connection closed by peer"). So the
# failure is written down where every rank can read it -- the job's torch.distributed store, under
# one key per job (and per torchrun restart), first writer wins (`compare_set`):
#
#   * a rank whose collective fails posts who it blames: after a timeout, the ranks that are stuck
#     nowhere -- every timed-out rank checks in as "stuck in group G" and waits a few seconds for the
#     others (they time out together), then follows the members stuck in other groups to those
#     groups, so rank 0 waiting for rank 3, itself waiting for a hung rank 2, names 2, not 3;
#     otherwise the peer the transport named, or a group member whose pid is gone on this host;
#   * a rank that dies of an uncaught exception posts itself (sys.excepthook) before it exits;
#   * a survivor reads the first post (waiting at most a few seconds for one) and says
#     "rank 2 failed first: <reason>" on top of its own error, which stays the cause.
#
# A rank killed outright posts nothing; the first survivor that notices (the shm transport's liveness
# check, or a dead pid among the group's members on this host) posts it. The transport can report the
# dead rank's closed connection before its pid looks gone to a peer (under load, 2-5 runs in 60 of
# tests/multiproc/test_culprits.py's killed case): a survivor that names nobody at once keeps looking
# at its group's pids, on every poll of its wait for another rank's post. Every store operation is
# bounded: the store may have died with its host rank, and then a survivor says what it knows itself.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "Failure",
    "FailureBoard",
    "culprit_message",
    "host_id",
    "pid_alive",
]

SETTLE_S = 3.0  # how long a failing rank waits for the others' posts and check-ins
_POLL_S = 0.05


class CollectiveError(RuntimeError):
    """A collective failed; `culprit` is the global rank that failed first when one is known."""

    def __init__(self, message: str, culprit: int | None = None) -> None:
        super().__init__(message)
        self.culprit = culprit


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete within its timeout."""


@dataclass(frozen=True)
class Failure:
    """What a rank posted: `rank` failed (died, hung, raised) for `reason`; `reporter` saw it."""

    rank: int
    reason: str
    reporter: int

    def encode(self) -> str:
        return f"{self.rank}\n{self.reporter}\n{self.reason}"

    @classmethod
    def decode(cls, text: str) -> Failure:
        rank, reporter, reason = text.split("\n", 2)
        return cls(int(rank), reason, int(reporter))


def host_id() -> str:
    """Same value for processes that can share /dev/shm and see each other's pids: the host name plus
    the kernel's boot id."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}"


def pid_alive(pid: int) -> bool:
    """kill(pid, 0) succeeds and the process is no zombie (a killed rank stays one until reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    state = stat.rsplit(")", 1)[-1].split()
    return not state or state[0] not in ("Z", "X")


def _root(store: Any) -> Any:
    """The store under every PrefixStore: a failure in one process group is the whole job's."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


class FailureBoard:
    """The job's record of its first failure, in the torch.distributed store (see the Note above).

    Every method swallows store errors: a board that cannot be reached knows nothing."""

    def __init__(self, store: Any, rank: int) -> None:
        self._store = _root(store)
        self.rank = rank
        self._prefix = f"shardpar/failure/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self._procs: dict[int, str] = {}  # the "host|pid" each rank posted, once read (it never changes)
        self._host = host_id()
        self._try(lambda: self._store.set(self._key(f"proc/{rank}"), f"{self._host}|{os.getpid()}"))
        _hook_excepthook(self)

    def _key(self, name: str) -> str:
        return self._prefix + name

    @staticmethod
    def _try(fn: Any, default: Any = None) -> Any:
        try:
            return fn()
        except Exception:  # the store is gone (its host died) or unreachable: nothing to add
            return default

    def _read(self, name: str) -> str | None:
        key = self._key(name)
        if not self._try(lambda: self._store.check([key]), False):
            return None
        value = self._try(lambda: self._store.get(key))
        return None if value is None else bytes(value).decode(errors="replace")

    def post(self, culprit: int, reason: str) -> None:
        """Record `culprit` as the first failure, unless another rank already recorded one."""
        entry = Failure(culprit, reason, self.rank).encode()
        self._try(lambda: self._store.compare_set(self._key("first"), "", entry))

    def first(self, wait_s: float = 0.0) -> Failure | None:
        """The first failure posted, waiting up to `wait_s` seconds for one."""
        deadline = time.monotonic() + wait_s
        while True:
            text = self._read("first")
            if text is not None:
                try:
                    return Failure.decode(text)
                except ValueError:
                    return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(_POLL_S)

    def dead_members(self, ranks: Sequence[int]) -> list[int]:
        """Members of `ranks` on this host whose process is gone (their posted pid)."""
        dead = []
        for r in ranks:
            if r == self.rank:
                continue
            text = self._procs.get(r) or self._read(f"proc/{r}")
            if text:  # read once: a survivor watching its group polls the pids, not the store
                self._procs[r] = text
            host, _, pid = (text or "").rpartition("|")
            if host == self._host and pid.isdigit() and not pid_alive(int(pid)):
                dead.append(r)
        return dead

    def missing_after_timeout(self, ranks: Sequence[int], settle_s: float = SETTLE_S) -> list[int]:
        """The ranks that never reached a collective: check in as stuck in the group `ranks`, wait up
        to `settle_s` for the other stuck ranks to do the same (they time out at about the same
        time), then follow the members that are stuck elsewhere to their groups; the ranks reached
        that are stuck nowhere are the culprits (sorted). Empty when every one is stuck somewhere."""
        self._try(lambda: self._store.set(self._key(f"stuck/{self.rank}"), ",".join(map(str, ranks))))
        deadline = time.monotonic() + settle_s
        while True:
            missing = self._not_stuck(ranks)
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(_POLL_S)

    def _not_stuck(self, ranks: Sequence[int]) -> list[int]:
        seen, todo, missing = set(ranks), list(ranks), []
        while todo:
            rank = todo.pop()
            text = self._read(f"stuck/{rank}")
            if text is None:
                missing.append(rank)
                continue
            for other in (int(r) for r in text.split(",") if r):
                if other not in seen:
                    seen.add(other)
                    todo.append(other)
        return sorted(missing)


def culprit_message(
    board: FailureBoard | None,
    local: str,
    *,
    ranks: Sequence[int],
    culprit: int | None,
    timed_out: bool,
) -> tuple[str, int | None]:
    """The message for a failed collective on the group `ranks` and the rank that failed first, after
    posting what this rank knows. `local` is this rank's own error; `culprit` the rank it names, if
    any (after a timeout only a hint: that rank may itself be stuck waiting for another)."""
    if board is None:
        return local, culprit
    reason = local
    if timed_out:
        missing = board.missing_after_timeout(ranks)
        if missing:
            culprit = missing[0]
            reason = f"it never reached a collective that its peers timed out waiting in ({local})"
    if culprit is not None:
        board.post(culprit, reason)
        first = board.first()
    else:
        culprit, reason, first = _watch_for_a_culprit(board, ranks, local)
    if first is None and culprit is not None:  # the store went away (with its host rank)
        return f"rank {culprit} failed first, as far as rank {board.rank} can tell (no store): {reason}", culprit
    if first is None:
        return f"{local}; no rank posted a failure to the job's store", culprit
    if first.reporter == board.rank and first.reason == reason:
        return f"rank {first.rank} failed first: {reason}", first.rank
    return (
        f"{local}; rank {first.rank} failed first: {first.reason} (reported by rank {first.reporter})",
        first.rank,
    )


def _watch_for_a_culprit(
    board: FailureBoard, ranks: Sequence[int], local: str
) -> tuple[int | None, str, Failure | None]:
    """Nothing named here yet: wait (2 x SETTLE_S at most) for a member of `ranks` on this host to be
    gone, which this rank then posts, or for another rank's post (the one that saw the failure first
    may still be writing it). Both are looked at on every poll: a member whose connection closed may
    not look gone at the first look (see the Note)."""
    deadline = time.monotonic() + 2 * SETTLE_S
    while True:
        dead = board.dead_members(ranks)
        if dead:
            reason = f"its process is gone ({local})"
            board.post(dead[0], reason)
            return dead[0], reason, board.first()
        first = board.first()
        if first is not None or time.monotonic() >= deadline:
            return None, local, first
        time.sleep(_POLL_S)


_HOOKED: list[FailureBoard] = []
_HOOK_LOCK = threading.Lock()


def _hook_excepthook(board: FailureBoard) -> None:
    """A rank that dies of an uncaught exception posts itself first (once per process)."""
    with _HOOK_LOCK:
        _HOOKED[:] = [board]
        if getattr(sys.excepthook, "_shardpar", False):
            return
        previous = sys.excepthook

        def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
            if _HOOKED and not isinstance(exc, KeyboardInterrupt):
                blamed = getattr(exc, "culprit", None)  # a collective error names its culprit already
                board = _HOOKED[0]
                board.post(board.rank if blamed is None else blamed, f"raised {kind.__name__}: {exc}")
            previous(kind, exc, tb)

        hook._shardpar = True  # type: ignore[attr-defined]
        sys.excepthook = hook
