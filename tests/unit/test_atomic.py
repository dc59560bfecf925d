"""Crash windows of checkpoint publishing ([Note: re-saving a tag] in shardpar/checkpoint/atomic.py).

The crash is simulated in this process: os.rename raises a BaseException at the chosen call, so
nothing after it runs, as if the process had died there. (tests/multiproc/test_checkpoint.py
SIGKILLs real ranks at the same point.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import shardpar as smp
from shardpar.checkpoint import atomic
from tests import models


class _Crash(BaseException):
    """Stands for the process dying: not an Exception, so no cleanup handler catches it."""


def _crash_on_rename(monkeypatch: pytest.MonkeyPatch, *, call: int, only_dirs: bool = True) -> None:
    """Make the `call`-th os.rename of a directory (1-based) raise _Crash instead of renaming."""
    real, count = os.rename, [0]

    def rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if not only_dirs or Path(src).is_dir():
            count[0] += 1
            if count[0] == call:
                raise _Crash(f"crashed before renaming {src} -> {dst}")
        real(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename)


def _checkpoint_dir(root: Path, tag: str, content: str) -> Path:
    d = root / f"{tag}_partial"
    d.mkdir(parents=True)
    (d / "index.json").write_text(content)
    return d


def _resave(root: Path, tag: str, content: str) -> None:
    # `with`: a crash (_Crash) releases the directory's lock, as a dying process does
    with atomic.make_tmp_dir(root, tag) as tmp:
        (tmp.path / "index.json").write_text(content)
        atomic.publish_dir(tmp.path, root / f"{tag}_partial")


def _listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_crash_between_the_renames_of_a_resave_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _checkpoint_dir(tmp_path, "t", "old")
    _crash_on_rename(monkeypatch, call=2)  # rename 1 (old aside) happens, rename 2 (tmp -> t_partial) not
    with pytest.raises(_Crash):
        _resave(tmp_path, "t", "new")
    monkeypatch.undo()
    assert not (tmp_path / "t_partial").exists()  # the window: no directory under the tag's name
    # the next save (of any tag) clears the crashed .tmp-* but restores the previous checkpoint
    atomic.make_tmp_dir(tmp_path, "other").release()
    assert (tmp_path / "t_partial" / "index.json").read_text() == "old"
    assert [n for n in _listing(tmp_path) if not n.startswith(".tmp-other-")] == ["t_partial"]


def test_crash_after_the_second_rename_keeps_the_new_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _checkpoint_dir(tmp_path, "t", "old")
    _crash_on_rename(monkeypatch, call=3)  # both renames done; moving the old copy to the trash is not
    with pytest.raises(_Crash):
        _resave(tmp_path, "t", "new")
    monkeypatch.undo()
    assert any(n.startswith(".old-t_partial-") for n in _listing(tmp_path)), _listing(tmp_path)
    assert atomic.recover(tmp_path) == []  # nothing to restore: the published save wins
    assert (tmp_path / "t_partial" / "index.json").read_text() == "new"
    assert _listing(tmp_path) == ["t_partial"]


def test_a_half_deleted_directory_is_never_restored(tmp_path: Path) -> None:
    """remove_dir's trash may be half gone: recovery must not bring it back under the tag's name."""
    trash = tmp_path / ".trash-t_partial-0123abcd"
    trash.mkdir()
    (trash / "shard-00001.safetensors").write_bytes(b"half")
    assert atomic.recover(tmp_path) == []
    atomic.make_tmp_dir(tmp_path, "next").release()
    assert [n for n in _listing(tmp_path) if not n.startswith(".tmp-next-")] == []


def test_tag_names_with_dashes_are_restored_whole(tmp_path: Path) -> None:
    old = tmp_path / ".old-run-3-step-10_partial-89abcdef"
    old.mkdir()
    assert atomic.recover(tmp_path) == ["run-3-step-10_partial"]
    assert _listing(tmp_path) == ["run-3-step-10_partial"]


# ---- the facade, world 1: save, crash while re-saving the same tag, resume ----------------------


def _crash_resave(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, save: Callable[[], None]) -> None:
    _crash_on_rename(monkeypatch, call=2)
    with pytest.raises(_Crash):
        save()
    monkeypatch.undo()
    assert not (tmp_path / "good_partial").exists(), "the crash must hit the window between the renames"


@pytest.mark.parametrize("tag", ["good", None])
def test_resume_after_a_crash_between_the_renames_gets_the_previous_checkpoint(
    world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tag: str | None
) -> None:
    model, opt = models.adamw_mlp(seed=0)
    models.train_mlp(model, opt, range(2))
    smp.save_checkpoint(tmp_path, "good", model=model, optimizer=opt, user_content={"tag": "good"})
    saved = models.model_and_optimizer_state(model, opt)
    models.train_mlp(model, opt, range(2, 4))
    _crash_resave(tmp_path, monkeypatch, lambda: smp.save_checkpoint(tmp_path, "good", model=model, optimizer=opt))

    fresh, fresh_opt = models.adamw_mlp(seed=7)
    assert smp.resume_from_checkpoint(tmp_path, tag) == {"tag": "good"}
    resumed = models.model_and_optimizer_state(fresh, fresh_opt)
    assert resumed.keys() == saved.keys()
    for k in saved:
        assert torch.equal(resumed[k], saved[k]), f"{k} differs from the previous checkpoint"
    assert (tmp_path / "newest").read_text() == "good"
    assert not any(n.startswith(".old-") for n in _listing(tmp_path)), _listing(tmp_path)


@pytest.mark.parametrize("tag", ["step100_partial", "a_partial"])
def test_a_tag_ending_in_partial_is_refused(tag: str) -> None:
    # A full export tagged "a_partial" would be published over the partial checkpoint "a" (and a
    # partial save tagged "a" over a full export "a_partial"), deleting it.
    with pytest.raises(ValueError, match=rf"checkpoint tag '{tag}' must not end in '_partial': partial checkpoints"):
        atomic.check_tag(tag)
    atomic.check_tag(tag.replace("_partial", "_part"))  # a near name is fine
