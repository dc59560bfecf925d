"""CommStats keeps a bounded window of per-step records: no growth with the step count (issue 24, item 5)."""

from __future__ import annotations

import tracemalloc

import pytest
import torch

from shardpar.collectives.stats import CommRecord, CommStats


def _rec(i: int) -> CommRecord:
    return CommRecord("all_gather", "sharding", 2, 4 * i, torch.float32, True, "native")


def _run(stats: CommStats, steps: int, per_step: int = 17) -> None:
    for step in range(steps):
        for i in range(per_step):
            stats.record(_rec(step * per_step + i))
        stats.begin_step()


def test_history_keeps_the_last_max_steps_steps() -> None:
    stats = CommStats(max_steps=4)
    _run(stats, 10, per_step=3)
    assert stats.num_steps == 10 and len(stats.history) == 4
    # the newest four steps, oldest first, each complete
    assert [[r.bytes for r in step] for step in stats.history] == [
        [4 * (3 * s + i) for i in range(3)] for s in range(6, 10)
    ]


def test_memory_is_flat_over_10000_steps_and_reset_frees_it() -> None:
    stats = CommStats()
    tracemalloc.start()
    try:
        _run(stats, 1000)  # the window is full (of traced records) from step max_steps on
        warm, _ = tracemalloc.get_traced_memory()
        _run(stats, 9000)
        grown, _ = tracemalloc.get_traced_memory()
        stats.reset()
        after_reset, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # unbounded, 9,000 steps of 17 records kept ~20 MiB more; bounded, nothing but the window
    assert abs(grown - warm) < 4096, f"grew {grown - warm} bytes from step 1,000 to 10,000"
    assert warm - after_reset > 32 * 17 * 50, (warm, after_reset)  # reset gave the window's records back
    assert stats.num_steps == 0 and not stats.history and not stats.current


def test_a_step_that_is_never_closed_is_bounded_too() -> None:
    """A forward-only loop never steps the optimizer: the running step rolls over into the window."""
    stats = CommStats(max_steps=3, max_records_per_step=5)
    for i in range(23):
        stats.record(_rec(i))
    assert len(stats.current) == 3 and len(stats.history) == 3 and stats.num_steps == 4
    assert all(len(step) == 5 for step in stats.history)
    assert [r.bytes for r in stats.current] == [80, 84, 88]


def test_steps_since_returns_the_new_steps_or_refuses() -> None:
    stats = CommStats(max_steps=3)
    _run(stats, 5, per_step=1)
    closed = stats.num_steps
    assert stats.steps_since(closed) == []
    _run(stats, 2, per_step=1)
    assert [[r.bytes for r in s] for s in stats.steps_since(closed)] == [[0], [4]]  # _run counts from 0
    with pytest.raises(ValueError, match=r"steps_since\(1\): 7 steps were closed and the window keeps the last 3"):
        stats.steps_since(1)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_window_sizes_are_checked(bad: object) -> None:
    with pytest.raises(ValueError, match=r"max_steps=.* must be an integer >= 1"):
        CommStats(max_steps=bad)  # type: ignore[arg-type]
