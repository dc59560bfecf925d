"""The smddp process group's decision to use shm, taken alike by every member (no torchrun needed:
two threads stand for two ranks on one store)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from shardpar.collectives import shm
from shardpar.collectives.torch_backend import SmddpProcessGroup


def _decide_on_threads(world: int) -> dict[int, str]:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=10))
    results: dict[int, str] = {}

    def member(rank: int) -> None:
        results[rank] = SmddpProcessGroup._why_not_shm(store, rank, world)

    threads = [threading.Thread(target=member, args=(r,), name=f"rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_a_member_without_shm_sends_every_member_to_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before, rank 1 returned at once and rank 0 waited in store.get for rank 1's host until the
    # store's timeout (30 min by default).
    def available() -> tuple[bool, str]:
        return (False, "test: no transport") if threading.current_thread().name == "rank1" else (True, "")

    monkeypatch.setattr(shm, "available", available)
    assert _decide_on_threads(2) == {0: "rank 1: test: no transport", 1: "rank 1: test: no transport"}


def test_members_on_two_hosts_go_to_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "available", lambda: (True, ""))
    monkeypatch.setattr(shm, "host_id", lambda: threading.current_thread().name[-1:])  # "0", "1", "2"
    assert _decide_on_threads(3) == {r: "members on 3 hosts" for r in range(3)}
