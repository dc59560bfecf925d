"""The smddp engine's options (from the config, else the reference's SMDDP_* environment variables)
and its Work: a step queued on the engine's worker thread, waited for with a bounded deadline."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass

from shardpar.collectives.base import Group

DEFAULT_AG_SCRATCH_BYTES = 16 * 1024 * 1024
DEFAULT_AG_SORT_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class SmddpOptions:
    """What the engine needs from the config; None fields are read from the environment."""

    timeout_s: float = 300.0
    ranks_per_node: int | None = None
    ag_scratch_bytes: int | None = None
    ag_sort_bytes: int | None = None
    # sdp_hierarchical_allgather: off, a gather over a group spanning nodes goes native ("hierarchical_off").
    hierarchical_allgather: bool = True

    def resolved(self, world: int) -> SmddpOptions:
        env = os.environ
        rpn = self.ranks_per_node or int(env.get("LOCAL_WORLD_SIZE", world) or world)
        scratch = self.ag_scratch_bytes or int(env.get("SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES", DEFAULT_AG_SCRATCH_BYTES))
        sort = self.ag_sort_bytes or int(env.get("SMDDP_AG_SORT_BUFFER_SIZE_BYTES", DEFAULT_AG_SORT_BYTES))
        return SmddpOptions(self.timeout_s, rpn, scratch, sort, self.hierarchical_allgather)


class SmddpWork:
    """A step queued on the engine's worker; `wait` re-raises its error, or TimeoutError.

    By default `wait` allows twice the engine's timeout plus 10 s, counted from the call to `wait`:
    inside the step every shm wait already has the engine's timeout and fails naming the missing
    peer, and that error (raised here) is the useful one. This deadline is the backstop for a
    worker that stopped making progress at all. `explain` turns a failure into the error to raise
    (the engine's: it names the rank that failed first); without it the step's error is raised."""

    def __init__(
        self,
        future: Future[None],
        timeout_s: float,
        op: str = "collective",
        group: Group | None = None,
        explain: Callable[[BaseException, bool], BaseException] | None = None,
    ) -> None:
        self._future, self._timeout_s, self._op, self._group = future, timeout_s, op, group
        self._explain = explain

    def wait(self, timeout: float | None = None) -> None:
        seconds = 2 * self._timeout_s + 10 if timeout is None else timeout
        # Not future.result(timeout): its TimeoutError is the builtin one (Python >= 3.11), which the
        # step's own ShmTimeoutError subclasses, so catching it would hide the transport's message.
        done, _ = futures.wait([self._future], timeout=seconds)
        if not done:
            where = f" on {self._group.kind} group {list(self._group.ranks)}" if self._group is not None else ""
            stuck = TimeoutError(
                f"smddp {self._op}{where} did not finish within {seconds:g} s of waiting for it "
                f"(collective_timeout_s={self._timeout_s:g}); look for an earlier error on another rank, or raise "
                "collective_timeout_s if the ranks are only slow"
            )
            if self._explain is None:
                raise stuck
            raise self._explain(stuck, True)
        error = self._future.exception()
        if error is None:
            return
        if self._explain is None:
            raise error
        explained = self._explain(error, False)
        if explained is error:
            raise error
        raise explained from error

    def is_completed(self) -> bool:
        return self._future.done()
