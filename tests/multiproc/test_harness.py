"""The harness itself: a rank that raises, dies or hangs fails the test with that rank's story."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import RankFailure, RankPool, worker_resources


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

    # _hang_on_rank1 never returns, so pool.run returning at all shows the harness cut the hang off; the
    # dumped stack shows where rank 1 was. The thread's join bounds the test if it did not (a generous
    # bound, 40x the case's timeout: no assertion on how long the cut-off took).
    pool = RankPool(2)
    outcome: list[BaseException | None] = []

    def hang() -> None:
        try:
            pool.run(_hang_on_rank1, timeout=3.0)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    runner = threading.Thread(target=hang, daemon=True)
    try:
        runner.start()
        runner.join(timeout=120.0)
        assert not runner.is_alive(), "the harness never cut off a hung rank"
    finally:
        pool.close()
    assert isinstance(outcome[0], RankFailure), outcome
    assert re.search(r"(?s)rank 1 did not finish.*_hang_on_rank1", str(outcome[0])), outcome[0]


def _train_a_step() -> None:
    """smp.init, wrap, one step with an optimizer, and the pp group: everything a case makes."""
    import shardpar as smp

    smp.init({"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 10})
    model = smp.DistributedModel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    model.backward(model(torch.randn(4, 8)).sum())
    opt.step()
    smp.get_pp_process_group()
    dist.new_group([0, 1])  # a group a test makes itself and leaves behind


def test_serving_cases_leaves_no_threads_or_groups_behind() -> None:
    """Issue 29 item 8: each case's gloo groups (3 threads each) piled up in the pool's workers. After
    the first case (which starts torch's lazy threads) more cases add no thread and no group."""
    pool = RankPool(2)
    try:
        pool.run(_train_a_step)
        first = pool.run(worker_resources)
        for _ in range(4):
            pool.run(_train_a_step)
        later = pool.run(worker_resources)
    finally:
        pool.close()
    for rank, (a, b) in enumerate(zip(first, later, strict=True)):
        assert a["process_groups"] == b["process_groups"] == 1, (rank, a, b)  # WORLD alone
        assert b["threads"] <= a["threads"], f"rank {rank}: {a['threads']} threads after 1 case, {b['threads']} after 5"
