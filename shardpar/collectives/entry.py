"""Calls that gather from every rank agree on what they are before any rank sends a byte
([Note: collective entry]).

# [Note: collective entry]
# `model.state_dict()`, `save_pretrained`, `smp.save_checkpoint`, `smp.barrier()` are collectives:
# each runs AllGathers over the sharding and TP groups (or a world barrier). Written the way one writes
# a plain PyTorch script -- `if smp.rank() == 0: model.save_pretrained(out)` -- rank 0's gathers pair
# with whatever the other ranks run next (their next forward's AllGathers, a barrier): a hang that
# names another rank, or gathers of the wrong tensors that happen to have the right size.
#
# So such a call first checks in, in the job's torch.distributed store (no collective, so it cannot
# pair with anything). Under `<job>/<init>/<n>/`, n counting this rank's checked calls since smp.init,
# rank r sets `rank/<r>` = the call's name, offers "r|name" as `first` (the first writer wins), adds 1
# to `arrived` (the last to arrive sets `all`) and waits for `all`: a handful of store operations per
# rank, O(world) for the job (waiting on every rank's own key would be O(world^2) at the store).
#   * one name: go on;
#   * a rank whose name is not `first`'s records both in `conflict` before it arrives, and raises at
#     once; the others, woken by `all`, find `conflict` and raise too (rank 0 in save_pretrained while
#     the others wait in smp.barrier(): every rank raises at once, naming both calls);
#   * `all` never comes within collective_entry_timeout_s: the caller raises, naming the ranks whose
#     `rank/<r>` is missing.
# Every rank makes the same checked calls in the same order -- that is what a collective demands -- so
# the counts agree. Calls nested in a checked call (save_pretrained's state_dict) are not counted.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["CollectiveEntryError", "EntryCheck", "job_store"]


class CollectiveEntryError(RuntimeError):
    """A collective was called on some ranks only, or ranks called different collectives."""


class EntryCheck:
    """Check-in before a gathering call (see the Note). `store` is the job's torch.distributed store
    (None: a world of one, nothing to check); `generation` tells this check's keys from an earlier
    one's in the same store (smp.init counts its calls: every rank makes the same number)."""

    def __init__(self, store: Any, rank: int, ranks: Sequence[int], timeout_s: float, generation: int = 0) -> None:
        while hasattr(store, "underlying_store"):  # one namespace for the job, under every PrefixStore
            store = store.underlying_store
        self._store = store
        self.rank = rank
        self.ranks = tuple(ranks)
        self.timeout_s = timeout_s
        self._prefix = f"shardpar/entry/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{generation}/"
        self._count = 0
        self._local = threading.local()

    @contextlib.contextmanager
    def call(self, name: str, fix: str) -> Iterator[None]:
        """Around a gathering call named `name` (as the user wrote it); `fix` says how to call it right."""
        depth = getattr(self._local, "depth", 0)
        if depth == 0 and self._store is not None and len(self.ranks) > 1:
            self._check_in(name, fix)
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth

    def _check_in(self, name: str, fix: str) -> None:
        self._count += 1
        n = self._count
        me = f"{self.rank}|{name}"
        self._store.set(self._key(n, f"rank/{self.rank}"), name)  # read only to name the missing on a timeout
        first = self._store.compare_set(self._key(n, "first"), "", me).decode()  # first writer wins
        conflict = None
        if first.split("|", 1)[1] != name:  # record it before arriving: whoever wakes sees it
            conflict = f"{me}|{first}"
            self._store.compare_set(self._key(n, "conflict"), "", conflict)
        if self._store.add(self._key(n, "arrived"), 1) == len(self.ranks):
            self._store.set(self._key(n, "all"), "1")
            self._forget(n - 1, shared=True)  # every rank is past count n-1 (it arrived here)
        if conflict is not None:
            raise self._mismatch(name, conflict, fix)  # at once: the others are woken by our arrival
        try:
            self._store.wait([self._key(n, "all")], datetime.timedelta(seconds=self.timeout_s))
        except Exception:  # the store's timeout (DistStoreError): someone never came
            if not self._store.check([self._key(n, "conflict")]):
                others = [r for r in self.ranks if r != self.rank]
                missing = [r for r in others if not self._store.check([self._key(n, f"rank/{r}")])]
                raise CollectiveEntryError(
                    f"rank {self.rank} called {name}, a collective: it gathers from every rank, so every rank must "
                    f"call it, and ranks {missing} did not within collective_entry_timeout_s={self.timeout_s:g} "
                    f"s. {fix}"
                ) from None
        if self._store.check([self._key(n, "conflict")]):
            raise self._mismatch(name, self._store.get(self._key(n, "conflict")).decode(), fix)
        self._forget(n - 1, shared=False)

    def _key(self, count: int, what: str) -> str:
        return f"{self._prefix}{count}/{what}"

    def _forget(self, count: int, *, shared: bool) -> None:
        """Delete a finished count's keys: this rank's own, or (by the last to arrive at the next) the shared."""
        names = ("first", "conflict", "arrived", "all") if shared else (f"rank/{self.rank}",)
        for what in names if count > 0 else ():
            with contextlib.suppress(Exception):
                self._store.delete_key(self._key(count, what))

    def _mismatch(self, name: str, conflict: str, fix: str) -> CollectiveEntryError:
        """`conflict` = "r1|name1|r2|name2": two ranks in different calls; name the side that is not ours."""
        r1, name1, r2, name2 = conflict.split("|", 3)
        rank, other = (r2, name2) if name1 == name else (r1, name1)
        return CollectiveEntryError(
            f"rank {self.rank} is in {name} while rank {rank} is in {other}: collectives pair up across ranks, "
            f"and these two would exchange each other's data. Every rank must call {name} (it gathers from "
            f"every rank), and {other} too, in the same order. {fix}"
        )


def job_store(world: int) -> Any:
    """The job's torch.distributed store (None for a world of one, or where torch keeps it private)."""
    import torch.distributed as dist

    if world == 1 or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a private torch API: without it the entry check is off, nothing else changes
        return None
