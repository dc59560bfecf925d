"""Background staging of async saves (issue 32 item 1's stall): save_checkpoint(async_save=True) returns
before this rank's tensors are copied, forward and backward run meanwhile, and every official write of the
main values or optimizer state waits for the copy -- so the checkpoint holds the values of the call, byte
for byte those of a synchronous save at the same point."""

from __future__ import annotations

from pathlib import Path

from tests.multiproc import async_stage_cases as cases


def test_step_right_after_an_async_save_waits_for_its_staging_copy(ranks, tmp_path: Path) -> None:
    for rank, r in enumerate(ranks.run(2, cases.step_after_save_case, str(tmp_path))):
        assert r["staged_at_return"] is False, "the call returned after the copy: staging still blocks"
        assert r["staged_before_step"] is False and r["waits_before_step"] == 0, "forward/backward/clip waited"
        assert r["waits_after_step"] == 1 and r["seen"]["waited"] == ["DistributedOptimizer.step()"], r["seen"]
        assert r["seen"]["opened_by_wait"], "the step's wait released the copy"
        assert r["committed"] == str(tmp_path / "async" / "s_partial")
        assert r["sync"].keys() == r["async"].keys() and len(r["sync"]) == 3, sorted(r["sync"])
        for name, data in r["sync"].items():
            assert r["async"][name] == data, f"rank {rank}: {name} differs from the sync save (pre-step values)"


def test_writes_through_official_paths_wait_for_the_staging_copy(ranks, tmp_path: Path) -> None:
    for r in ranks.run(2, cases.writes_wait_case, str(tmp_path)):
        assert len(r) == 6, sorted(r)
        for name, w in r.items():
            assert w["seen"]["opened_by_wait"] and len(w["seen"]["waited"]) == 1, (name, w["seen"])
            assert w["same"] and w["files"] >= 2, f"{name}: the async checkpoint holds values written after the call"


def test_a_stuck_staging_copy_or_a_dead_writer_fails_the_step_within_a_bound(ranks, tmp_path: Path) -> None:
    for r in ranks.run(2, cases.stage_timeout_case, str(tmp_path)):
        assert "DistributedOptimizer.step() waited" in r["error"] and "'t'" in r["error"], r["error"]
        assert "STAGE_TIMEOUT_S" in r["error"], r["error"]
        assert r["committed"] == str(tmp_path / "t_partial") and len(r["losses"]) == 1
        assert r["died"].startswith("DistributedOptimizer.step(): the checkpoint writer of tag 'd' died"), r["died"]
        assert "failed on 2 of 2 ranks" in r["lost"] and "'d' died before it finished copying" in r["lost"], r["lost"]
