"""Checkpoint hygiene (issue 24, item 6): resume's tag check, and the removal of what crashed saves
left behind ([Note: stale temporary entries] in shardpar/checkpoint/atomic.py).

Real files, a world of one through the facade; a save in flight is a real second process holding
the directory's lock. tests/multiproc/test_checkpoint.py checks a resume after a real SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import shardpar as smp
from shardpar.checkpoint import atomic, load_consolidated
from tests import models

# ---- helpers -------------------------------------------------------------------------------------


# ---- resume validates an explicit tag ------------------------------------------------------------


@pytest.mark.parametrize("partial", [True, False])
def test_resume_refuses_a_tag_that_leaves_the_checkpoint_root(
    world_of_one: None, tmp_path: Path, partial: bool
) -> None:
    model, opt = models.adamw_mlp(seed=0)
    smp.save_checkpoint(tmp_path, "outside", model=model, optimizer=opt, partial=partial)
    root = tmp_path / "ckpt"  # "ckpt/../outside" is a real, loadable checkpoint outside `root`
    root.mkdir()
    leftover = root / ".tmp-x-0123456789ab"
    leftover.mkdir()
    fresh, fresh_opt = models.adamw_mlp(seed=7)
    before = models.model_and_optimizer_state(fresh, fresh_opt)
    with pytest.raises(ValueError, match=r"checkpoint tag '\.\./outside' must be a plain name \(no '/'"):
        smp.resume_from_checkpoint(root, "../outside", partial=partial)
    assert models.same_tensors(models.model_and_optimizer_state(fresh, fresh_opt), before)
    assert leftover.exists(), "refused before doing anything in the root"
    with pytest.raises(ValueError, match=r"checkpoint tag '\.\./outside' must be a plain name"):
        load_consolidated(root, "../outside")


# ---- stale temporary entries ---------------------------------------------------------------------


@contextlib.contextmanager
def _held_by_another_process(path: Path) -> Iterator[None]:
    """A live process holding `path`'s lock, as a save in flight in another job does."""
    code = (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); "
        "print('locked', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        yield
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)


def _crash_leftovers(root: Path) -> list[Path]:
    crashed = root / ".tmp-step1-0123456789ab"
    crashed.mkdir(parents=True)
    (crashed / "shard-00000.safetensors").write_bytes(b"x" * 4096)
    pointer = root / ".tmp-newest-89abcdef"
    pointer.write_text("step1")
    trash = root / ".trash-step0_partial-01234567"
    trash.mkdir()
    return [crashed, pointer, trash]


def _listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_sweep_removes_crash_leftovers_and_leaves_a_save_in_flight_alone(tmp_path: Path) -> None:
    leftovers = _crash_leftovers(tmp_path)
    live = tmp_path / ".tmp-step2-fedcba987654"
    live.mkdir()
    (live / "shard-00001.safetensors").write_bytes(b"y")
    only_copy = tmp_path / ".old-t_partial-76543210"  # a re-save between its renames: the only copy of t
    only_copy.mkdir()
    with _held_by_another_process(live):
        removed = atomic.sweep(tmp_path)
        assert sorted(removed) == sorted(p.name for p in leftovers)
        # in flight: kept, and so is the `.old-*` (the live save may be the one between its renames)
        assert _listing(tmp_path) == [only_copy.name, live.name]
        assert (live / "shard-00001.safetensors").read_bytes() == b"y"
    # its process is gone (a crash): the next sweep removes it and restores the only copy of t
    assert atomic.sweep(tmp_path) == [live.name, "t_partial"]
    assert _listing(tmp_path) == ["t_partial"]


def test_where_the_filesystem_cannot_lock_only_old_leftovers_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(atomic, "_try_lock", lambda path: (atomic.Lock.UNKNOWN, None))
    old, fresh = tmp_path / ".tmp-a-000000000000", tmp_path / ".tmp-b-111111111111"
    for d in (old, fresh):
        d.mkdir()
        (d / "shard-00000.safetensors").write_bytes(b"z")
    hours_ago = time.time() - 2 * atomic.STALE_AFTER_S
    for p in (old / "shard-00000.safetensors", old):
        os.utime(p, (hours_ago, hours_ago))
    assert atomic.sweep(tmp_path) == [old.name]
    assert _listing(tmp_path) == [fresh.name]


def test_a_pointer_being_written_is_not_swept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep (another job's) lands between writing `newest`'s temporary file and moving it in place."""
    real, swept = os.replace, []

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        swept.append(atomic.sweep(tmp_path))
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    atomic.write_text_atomic(tmp_path / "newest", "step3")
    assert swept == [[]] and (tmp_path / "newest").read_text() == "step3"
    assert _listing(tmp_path) == ["newest"]


def test_the_next_resume_and_the_next_save_remove_crash_leftovers(world_of_one: None, tmp_path: Path) -> None:
    model, opt = models.adamw_mlp(seed=0)
    smp.save_checkpoint(tmp_path, "good", model=model, optimizer=opt)
    _crash_leftovers(tmp_path)
    live = tmp_path / ".tmp-other-job-000000000000"
    live.mkdir()
    with _held_by_another_process(live):
        smp.resume_from_checkpoint(tmp_path, "good")
        assert _listing(tmp_path) == [live.name, "good_partial", "newest"]
        _crash_leftovers(tmp_path)
        smp.save_checkpoint(tmp_path, "next", model=model, optimizer=opt)
        assert _listing(tmp_path) == [live.name, "good_partial", "newest", "next_partial"]
    smp.resume_from_checkpoint(tmp_path)
    assert _listing(tmp_path) == ["good_partial", "newest", "next_partial"]
