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
# pair with anything): rank r sets `<job>/<init>/<n>/<r>` = the call's name, n counting this rank's
# checked calls since smp.init, then waits for every rank's key n.
#   * all there, one name: go on (a few store round trips);
#   * a rank is in ANOTHER checked call at the same count (rank 0 in save_pretrained while the others
#     wait in smp.barrier()): every rank involved raises at once, naming both calls;
#   * a rank never arrives within collective_entry_timeout_s: the caller raises, naming the ranks missing.
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

    def _key(self, count: int, rank: int) -> str:
        return f"{self._prefix}{count}/{rank}"

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
        self._store.set(self._key(n, self.rank), name)
        others = [r for r in self.ranks if r != self.rank]
        try:
            self._store.wait([self._key(n, r) for r in others], datetime.timedelta(seconds=self.timeout_s))
        except Exception:  # the store's timeout (DistStoreError): someone never came
            missing = [r for r in others if not self._store.check([self._key(n, r)])]
            if missing:
                raise CollectiveEntryError(
                    f"rank {self.rank} called {name}, a collective: it gathers from every rank, so every rank must "
                    f"call it, and ranks {missing} did not within collective_entry_timeout_s={self.timeout_s:g} "
                    f"s. {fix}"
                ) from None
        # one round trip for every name (multi_get), not one per rank
        values = self._store.multi_get([self._key(n, r) for r in others])
        names = {r: v.decode() for r, v in zip(others, values, strict=True)}
        elsewhere = {r: other for r, other in names.items() if other != name}
        if elsewhere:
            r, other = next(iter(elsewhere.items()))
            raise CollectiveEntryError(
                f"rank {self.rank} is in {name} while rank {r} is in {other}: collectives pair up across ranks, "
                f"and these two would exchange each other's data. Every rank must call {name} (it gathers from "
                f"every rank), and {other} too, in the same order. {fix}"
            )
        if n > 1:  # every rank has read count n-1 (it is at n): this rank's old key can go
            with contextlib.suppress(Exception):
                self._store.delete_key(self._key(n - 1, self.rank))


def job_store(world: int) -> Any:
    """The job's torch.distributed store (None for a world of one, or where torch keeps it private)."""
    import torch.distributed as dist

    if world == 1 or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a private torch API: without it the entry check is off, nothing else changes
        return None
