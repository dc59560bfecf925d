"""The harness itself: a rank that raises, dies or hangs fails the test with that rank's story."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import RankFailure, RankPool


def _rank_and_sum() -> tuple[int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _raise_on_rank1() -> None:
    if dist.get_rank() == 1:
        raise KeyError("boom from rank 1")


def _die_on_rank0() -> None:
    if dist.get_rank() == 0:
        os._exit(17)


def _hang_on_rank1() -> None:
    if dist.get_rank() == 1:
        while True:
            time.sleep(0.05)  # a deadlocked rank (name visible in the dumped stack)


def test_pool_runs_many_cases_and_reports_failures() -> None:
    pool = RankPool(2)
    try:
        assert pool.run(_rank_and_sum) == [(0, 3.0), (1, 3.0)]
        assert pool.run(_rank_and_sum) == [(0, 3.0), (1, 3.0)], "the same processes serve a second case"
        with pytest.raises(RankFailure, match=r"(?s)rank 1 \(err\).*KeyError: 'boom from rank 1'"):
            pool.run(_raise_on_rank1)
    finally:
        pool.close()

    pool = RankPool(2)
    try:
        with pytest.raises(RankFailure, match=r"rank 0 died with exit code 17"):
            pool.run(_die_on_rank0)
    finally:
        pool.close()

    pool = RankPool(2)
    start = time.monotonic()
    try:
        with pytest.raises(RankFailure, match=r"(?s)rank 1 did not finish.*_hang_on_rank1"):
            pool.run(_hang_on_rank1, timeout=3.0)
    finally:
        pool.close()
    assert time.monotonic() - start < 30, "a hang must be cut off near its timeout"
