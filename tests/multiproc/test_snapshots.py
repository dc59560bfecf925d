"""In-memory snapshots (issue 32 item 2): world 4 / sdp 2 (two replicas), snapshots at steps 2 and 4,
a disk checkpoint at step 3, then a "crash". The resume takes the newest complete state: the step-4
snapshot, also when one rank's files are gone (its replica peer's are read, or sent), and the losses of
the steps after it are exactly the straight run's (fp32); a damaged snapshot or one without a copy
(shard_optimizer_state) falls back to the disk; a normal finish removes the files."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.multiproc import snapshot_cases as cases


@pytest.fixture(scope="module")
def straight(ranks, tmp_path_factory) -> dict[str, Any]:
    """One straight run per layout; each test resumes from a fresh copy of its snapshots and disk files."""
    out: dict[str, Any] = {}
    for name, knobs in (("plain", {}), ("sos", {"shard_optimizer_state": True})):
        base = tmp_path_factory.mktemp(name)
        results = ranks.run(4, cases.straight_case, str(base / "ckpt"), str(base / "shm"), knobs)
        out[name] = (base, knobs, results)
    return out


def _resume(ranks, straight, tmp_path: Path, layout: str, mode: str, disk: bool = True) -> list[dict[str, Any]]:
    base, knobs, results = straight[layout]
    shutil.copytree(base / "shm", tmp_path / "shm")
    root = tmp_path / "ckpt"
    if disk:
        shutil.copytree(base / "ckpt", root)
    resumed = ranks.run(4, cases.resume_case, str(root), str(tmp_path / "shm"), knobs, mode)
    losses = results[0]["losses"]
    for r in resumed:
        assert r["losses"] == losses[r["start"] :], (mode, r["start"], r["losses"], losses)  # exact: fp32
        assert r["left"] is None, r["left"]  # the normal finish removed every rank's files and the directory
    return resumed


def test_snapshots_are_written_every_interval_and_double_buffered(straight) -> None:
    for rank, r in enumerate(straight["plain"][2]):
        written = r["written"]
        assert written[0] is None and written[2] is None  # steps 1 and 3: not a multiple of the interval
        assert written[1].endswith(f"rank{rank:05d}.0.snap") and written[3].endswith(f"rank{rank:05d}.1.snap")


def test_resume_takes_the_newest_snapshot_over_an_older_disk_checkpoint(ranks, straight, tmp_path: Path) -> None:
    for r in _resume(ranks, straight, tmp_path, "plain", "all"):
        assert r["start"] == 4 and r["source"]["source"] == "memory", r["source"]


@pytest.mark.parametrize("mode", ["peer", "send"])
def test_a_lost_rank_resumes_from_its_replica_peers_snapshot(ranks, straight, tmp_path: Path, mode: str) -> None:
    for r in _resume(ranks, straight, tmp_path, "plain", mode):
        assert r["start"] == 4 and r["source"]["source"] == "memory", r["source"]
        sent = 1 if mode == "send" else 0
        assert f"1 rank(s) from a replica peer's snapshot ({sent} sent)" in r["source"]["description"], r["source"]


def test_a_rank_killed_while_writing_leaves_the_previous_snapshot(ranks, straight, tmp_path: Path) -> None:
    # shard_optimizer_state: rank 0's step 4 has no copy on its replica peer (rank 2), so step 2 is the newest
    # complete one (with replicas, rank 2's step 4 would stand in for it: the "peer" test)
    for r in _resume(ranks, straight, tmp_path, "sos", "torn", disk=False):
        assert r["start"] == 2 and r["source"]["source"] == "memory", r["source"]


def test_a_corrupt_snapshot_falls_back_to_the_disk_checkpoint(ranks, straight, tmp_path: Path) -> None:
    resumed = _resume(ranks, straight, tmp_path, "plain", "corrupt")
    for r in resumed:
        assert r["start"] == 3 and r["source"]["source"] == "disk", r["source"]
    assert "checksum" in resumed[0]["warnings"][0] and "rank 2" in resumed[0]["warnings"][0], resumed[0]["warnings"]


def test_shard_optimizer_state_leaves_no_copy_so_a_lost_rank_means_disk(ranks, straight, tmp_path: Path) -> None:
    for r in _resume(ranks, straight, tmp_path, "sos", "no_peer"):
        assert r["start"] == 3 and r["source"]["source"] == "disk", r["source"]
