"""Snapshot files on their own (world of one): the interval, the double buffer, a torn or damaged file,
bad arguments, and that a normal shutdown removes them but an exception on its way out does not."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import shardpar as smp
from shardpar.checkpoint import snapshot
from tests import models
from tests.conftest import init_world_of_one


def _train_one(model: smp.DistributedModel, opt: smp.DistributedOptimizer) -> None:
    batch = models.mlp_batch(0, 4)
    model.backward(model(**batch))
    opt.step()
    opt.zero_grad()


@pytest.fixture
def shm_world(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    with init_world_of_one(monkeypatch, checkpoint_snapshot_dir=str(tmp_path / "shm"), checkpoint_snapshot_interval=2):
        torch.manual_seed(0)
        model = smp.DistributedModel(models.UnevenMLP())
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        _train_one(model, opt)
        yield model, opt, tmp_path


def test_interval_double_buffer_and_damage(shm_world) -> None:  # type: ignore[no-untyped-def]
    _, _, tmp = shm_world
    root = tmp / "ckpt"
    assert smp.save_snapshot(root, 1) is None  # not a multiple of 2
    first, second = smp.save_snapshot(root, 2, {"step": 2}), smp.save_snapshot(root, 4, {"step": 4})
    assert first is not None and second is not None and first != second  # the two slots
    third = smp.save_snapshot(root, 6, {"step": 6})
    assert third == first  # the older slot (step 2) is the one replaced
    directory = Path(first).parent
    assert sorted(p.name for p in directory.iterdir()) == ["rank00000.0.snap", "rank00000.1.snap"]
    trailer = snapshot.read_trailer(Path(third))
    assert trailer is not None and trailer["step"] == 6 and trailer["peers"] == []
    snapshot.read_payload(Path(third), trailer)  # intact: no error
    data = bytearray(Path(third).read_bytes())
    data[5] ^= 0x10
    Path(third).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum crc32:"):
        snapshot.read_payload(Path(third), trailer)
    Path(third).write_bytes(bytes(data[: len(data) // 2]))  # torn: no trailer where the footer says
    assert snapshot.read_trailer(Path(third)) is None


def test_bad_arguments_name_the_value(shm_world) -> None:  # type: ignore[no-untyped-def]
    _, _, tmp = shm_world
    with pytest.raises(ValueError, match=r"step=-1"):
        smp.save_snapshot(tmp, -1)
    with pytest.raises(ValueError, match=r"every=-2"):
        smp.save_snapshot(tmp, 2, every=-2)
    with pytest.raises(ValueError, match=re.escape("checkpoint_snapshot_job='../x'")):
        snapshot.job_key(tmp, "../x")


def test_shutdown_removes_snapshots_only_on_a_normal_finish(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def run(fail: bool) -> Path:
        with init_world_of_one(monkeypatch, checkpoint_snapshot_dir=str(tmp_path / "shm"), checkpoint_snapshot_job="j"):
            model = smp.DistributedModel(models.UnevenMLP())
            opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
            _train_one(model, opt)
            written = Path(str(smp.save_snapshot(tmp_path, 1, every=1)))
            if fail:
                raise RuntimeError("a crash")
        return written

    with pytest.raises(RuntimeError, match="a crash"):
        run(fail=True)
    assert (tmp_path / "shm" / "shardpar-snap-j" / "rank00000.0.snap").exists()  # kept for the next start
    snapshot.written.clear()
    run(fail=False)
    assert not (tmp_path / "shm" / "shardpar-snap-j").exists()


def test_owner_held_state_is_in_the_snapshot_and_resumes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Owner-held optimizer state (Adafactor: not element-wise, stepped whole on its owner) goes into the
    owner's snapshot whole, as partial checkpoints write it (owned/<name>/<fqn>), and a resume from the
    snapshot restores it exactly (the multi-rank case: test_owner_compute.py)."""
    knobs = {"checkpoint_snapshot_dir": str(tmp_path / "shm"), "checkpoint_snapshot_interval": 2}

    def build(seed: int) -> tuple[smp.DistributedModel, smp.DistributedOptimizer]:
        torch.manual_seed(seed)
        model = smp.DistributedModel(models.UnevenMLP())
        return model, smp.DistributedOptimizer(torch.optim.Adafactor(model.parameters(), lr=1e-2))

    def owned(opt: smp.DistributedOptimizer) -> dict[str, torch.Tensor]:
        return {
            f"{fqn}:{k}": v.clone()
            for fqn, leaf, _ in opt.owned_leaves()
            for k, v in opt.state.get(leaf, {}).items()
            if isinstance(v, torch.Tensor)
        }

    with init_world_of_one(monkeypatch, **knobs):
        model, opt = build(0)
        _train_one(model, opt)
        written = smp.save_snapshot(tmp_path / "ckpt", 2, {"step": 2})
        saved = owned(opt)
        trailer = snapshot.read_trailer(Path(str(written)))
        snapshot.written.clear()  # a crash: the file stays
    assert trailer is not None and saved and any(k.endswith(":row_var") for k in saved), sorted(saved)
    fqns = {k.split(":")[0] for k in saved}
    assert set(trailer["owned"]) == fqns and not fqns & set(trailer["state"]), trailer["owned"].keys()
    assert {k for k in trailer["tensors"] if k.startswith("owned/")} == {
        f"owned/{k.split(':')[1]}/{k.split(':')[0]}" for k, v in saved.items() if v.dim() > 0
    }
    with init_world_of_one(monkeypatch, **knobs):
        model, opt = build(1)
        assert smp.resume_from_checkpoint(tmp_path / "ckpt") == {"step": 2}
        loaded = owned(opt)
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)


def test_removing_a_rank_tolerates_another_rank_removing_the_directory(tmp_path: Path) -> None:
    # Ranks finish together: once rank 0's files are gone, rank 1's remove_rank may rmdir the directory
    # between glob's is-it-a-directory check and its scandir (a FileNotFoundError there hung a CI barrier).
    directory = tmp_path / "shardpar-snap-j"
    directory.mkdir()
    snapshot.file_of(directory, 0, 0).write_bytes(b"x")
    scandir = Path._scandir  # type: ignore[attr-defined]

    def peer_rmdir_then_scandir(self: Path):  # type: ignore[no-untyped-def]
        if self == directory and directory.exists():
            directory.rmdir()  # the peer's rmdir: this rank's own file is already gone
        return scandir(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "_scandir", peer_rmdir_then_scandir)
        snapshot.remove_rank(directory, 0)
    assert not directory.exists()


def test_a_first_snapshot_survives_a_peer_removing_the_empty_directory(
    shm_world, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    # A peer finishing (smp.shutdown) removes the snapshot directory once no rank's file is in it; before
    # this rank's first file exists it is empty, and may go between write's mkdir and its open.
    _, _, tmp = shm_world
    collect = snapshot.collect
    removed: list[Path] = []

    def collect_then_peer_rmdir(model, optimizer):  # type: ignore[no-untyped-def]
        out = collect(model, optimizer)
        (directory,) = (tmp / "shm").iterdir()
        directory.rmdir()  # empty: this rank has written nothing yet
        removed.append(directory)
        return out

    monkeypatch.setattr(snapshot, "collect", collect_then_peer_rmdir)
    written = smp.save_snapshot(tmp / "ckpt", 2, {"step": 2})
    assert removed and written is not None and Path(written).parent == removed[0]
    trailer = snapshot.read_trailer(Path(written))
    assert trailer is not None and trailer["step"] == 2
    snapshot.read_payload(Path(written), trailer)
