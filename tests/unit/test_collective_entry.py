"""[Note: collective entry] (collectives/entry.py): a gathering call checks in through the job's store
before any rank sends a byte. Ranks are threads over one in-process store here; the multi-process
path (a rank-0-only save_pretrained on a wrapped model) is tests/multiproc/test_collective_entry.py."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
from torch.distributed import HashStore

from shardpar.collectives.entry import CollectiveEntryError, EntryCheck


def _ranks(n: int, timeout_s: float = 5.0) -> list[EntryCheck]:
    store = HashStore()
    return [EntryCheck(store, r, range(n), timeout_s) for r in range(n)]


def _on_threads(checks: list[EntryCheck], body: Callable[[int, EntryCheck], Any]) -> list[Any]:
    out: list[Any] = [None] * len(checks)

    def run(r: int) -> None:
        try:
            out[r] = body(r, checks[r])
        except CollectiveEntryError as e:
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(checks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def _call(check: EntryCheck, name: str) -> str:
    with check.call(name, "FIX"):
        return "done"


def test_every_rank_in_the_same_calls_goes_on_and_nested_calls_are_not_counted() -> None:
    def body(r: int, check: EntryCheck) -> list[str]:
        done = []
        for i in range(3):
            with check.call("save_pretrained()", "FIX"):
                done.append(_call(check, "model.module.state_dict()"))  # nested: no check-in
            done.append(_call(check, f"smp.barrier() #{i}"))
        return done

    results = _on_threads(_ranks(3), body)
    assert results == [["done"] * 6] * 3, results


def test_ranks_in_different_calls_both_raise_at_once_naming_both() -> None:
    """The classic: `if smp.rank() == 0: model.save_pretrained(out)` then `smp.barrier()` on every rank."""
    calls = ["save_pretrained()", "smp.barrier()", "smp.barrier()"]
    results = _on_threads(_ranks(3, timeout_s=60), lambda r, check: _call(check, calls[r]))
    assert all(isinstance(e, CollectiveEntryError) for e in results), results
    assert re.search(r"rank 0 is in save_pretrained\(\) while rank [12] is in smp.barrier\(\)", str(results[0]))
    assert "Every rank must call save_pretrained()" in str(results[0]) and str(results[0]).endswith("FIX")
    assert "rank 2 is in smp.barrier() while rank 0 is in save_pretrained()" in str(results[2])


def test_a_call_no_other_rank_makes_raises_on_the_caller_naming_the_missing_ranks() -> None:
    checks = _ranks(3, timeout_s=0.3)
    results = _on_threads(checks, lambda r, check: _call(check, "model.state_dict()") if r == 0 else "skipped")
    assert results[1:] == ["skipped", "skipped"]
    message = str(results[0])
    assert "rank 0 called model.state_dict(), a collective: it gathers from every rank, so every rank must" in message
    assert "ranks [1, 2] did not within collective_entry_timeout_s=0.3 s. FIX" in message


def test_a_world_of_one_checks_nothing() -> None:
    assert _call(EntryCheck(None, 0, [0], 1.0), "model.state_dict()") == "done"
    assert _call(EntryCheck(HashStore(), 0, [0], 1.0), "model.state_dict()") == "done"


def test_old_keys_are_deleted_once_every_rank_is_past_them() -> None:
    store = HashStore()
    checks = [EntryCheck(store, r, range(2), 5.0) for r in range(2)]
    _on_threads(checks, lambda r, check: [_call(check, "smp.barrier()") for _ in range(4)])
    keys = [checks[0]._key(n, what) for n in range(1, 5) for what in ("rank/0", "rank/1", "first", "all")]
    left = [k for k in keys if store.check([k])]
    # only the last count's keys stay (until the next call): count n-1's go once every rank is at n
    assert left == keys[-4:], left


@pytest.mark.parametrize("timeout_s", [0.0, -1.0])
def test_the_timeout_knob_must_be_positive(timeout_s: float) -> None:
    import shardpar as smp

    with pytest.raises(ValueError, match="collective_entry_timeout_s"):
        smp.init({"collective_entry_timeout_s": timeout_s})
