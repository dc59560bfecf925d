"""Crash-safe directories and rank agreement for checkpoints.

[Note: atomic checkpoints]
A save writes into `<root>/.tmp-<tag>-<id>/`. Only after every rank reported its files written
(one all-gather, which doubles as the "everyone finished" barrier) does rank 0 write the index,
rename the directory to its final name and then move the `newest` pointer (write a temporary file,
fsync, os.replace). A crash at any point before the rename leaves only a `.tmp-*` directory, which
the next save removes; the previous checkpoint and the pointer are untouched. Every phase runs
"locally, then agree": a rank that fails reports its error instead of leaving the collective, so
the others raise the same error instead of waiting; a rank that dies makes the collective fail
within the process group's timeout (collective_timeout_s).

[Note: re-saving a tag]
rename(2) cannot replace a non-empty directory, so publishing over an existing tag takes two renames:
the old directory to `.old-<name>-<id>`, then the temporary one to `<name>`. A crash between them
leaves no `<name>` and the only copy of the previous checkpoint under `.old-*`. Two rules make that
state harmless:

    .old-<name>-<id>    always a complete checkpoint (only publish_dir creates it, by a rename)
    .trash-<name>-<id>  being deleted, possibly half gone: never read, never restored

and `recover(root)` (rank 0, first thing in every save, every resume and load_consolidated) renames an
`.old-<name>-*` back to `<name>` when `<name>` is missing, and deletes it when `<name>` exists (the
new save was published). The crash states of a re-save and what recovery makes of them:

    before rename 1       old at <name>, new at .tmp-*        -> old kept, .tmp-* removed
    between the renames   old at .old-*, new at .tmp-*        -> old restored to <name>
    after rename 2        new at <name>, old at .old-*        -> new kept (complete), .old-* removed
    while deleting old    new at <name>, old at .trash-*      -> .trash-* removed

Simpler than the alternatives: an atomic exchange (renameat2 RENAME_EXCHANGE) is Linux-only and
fails on some filesystems, and unique directory names behind per-tag pointers would change the
layout users (and Hugging Face's from_pretrained) read.
"""

from __future__ import annotations

import json
import os
import shutil
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from shardpar.checkpoint.safetensors_io import CheckpointError
from shardpar.collectives import Engine, Group
from shardpar.collectives.native import all_gather_object, broadcast_object
from shardpar.topology import Topology

T = TypeVar("T")
TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
_OLD_PREFIX = ".old-"


@dataclass(frozen=True)
class Coordinator:
    """Runs a checkpoint phase on one or all ranks and makes every rank agree on its outcome."""

    topology: Topology
    engine: Engine

    @property
    def world(self) -> Group:
        return self.topology.group("world")

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def is_root(self) -> bool:
        return self.topology.rank == 0

    def on_root(self, what: str, fn: Callable[[], T]) -> T:
        """`fn()` on rank 0; its result on every rank, or its error raised on every rank."""
        result: Any = None
        failure: _Failure | None = None
        local: Exception | None = None
        if self.is_root:
            try:
                result = fn()
            except Exception as e:
                failure, local = _Failure.of(e), e
        result, failure = broadcast_object((result, failure), self.world.ranks[0], self.world)
        if failure is not None:
            raise _raise_type([failure])(f"{what} failed on rank 0: {failure.text}") from local
        return result

    def gather(self, what: str, fn: Callable[[], T]) -> list[T]:
        """`fn()` on every rank; every rank's result, or one error (naming the failed ranks) on every rank.

        A rank whose `fn` raised still joins the all-gather, so nobody waits for it in vain.
        """
        result: Any = None
        failure: _Failure | None = None
        local: Exception | None = None
        try:
            result = fn()
        except Exception as e:
            failure, local = _Failure.of(e), e
        reports = all_gather_object((result, failure), self.world)
        failed = [(r, f) for r, (_, f) in zip(self.world.ranks, reports, strict=True) if f is not None]
        if failed:
            lines = "\n".join(f"  rank {r}: {f.text}" for r, f in failed)
            message = f"{what} failed on {len(failed)} of {self.world.size} ranks:\n{lines}"
            raise _raise_type([f for _, f in failed])(message) from local
        return [r for r, _ in reports]


@dataclass(frozen=True)
class _Failure:
    kind: str
    text: str

    @classmethod
    def of(cls, e: Exception) -> _Failure:
        if isinstance(e, (ValueError, TypeError, OSError)):
            return cls(type(e).__name__, f"{type(e).__name__}: {e}")
        return cls(type(e).__name__, "".join(traceback.format_exception_only(type(e), e)).strip())


def _raise_type(failures: list[_Failure]) -> type[Exception]:
    """CheckpointError / ValueError / TypeError when every rank failed that way; else RuntimeError."""
    kinds = {f.kind for f in failures}
    for cls in (CheckpointError, ValueError, TypeError):
        if kinds == {cls.__name__}:
            return cls
    return RuntimeError


# ---- directories ---------------------------------------------------------------------------------


def check_tag(tag: str) -> None:
    if not isinstance(tag, str) or not tag or tag != tag.strip():
        raise ValueError(f"checkpoint tag {tag!r} must be a non-empty string without surrounding blanks")
    if "/" in tag or os.sep in tag or tag.startswith(".") or tag in ("newest", "newest_full"):
        raise ValueError(
            f"checkpoint tag {tag!r} must be a plain name (no '/', not starting with '.', not 'newest'); e.g. 'step100'"
        )
    if tag.endswith("_partial"):  # a full export named "x_partial" would replace partial checkpoint "x"
        raise ValueError(
            f"checkpoint tag {tag!r} must not end in '_partial': partial checkpoints live in '<tag>_partial', so "
            f"this name would replace (or be replaced by) the partial checkpoint {tag.removesuffix('_partial')!r}; "
            "e.g. 'step100'"
        )


def make_tmp_dir(root: Path, tag: str) -> tuple[str, str]:
    """Rank 0: clear what crashed saves left behind, create a fresh temporary directory.

    Returns (temporary directory, checkpoint id). One training job per checkpoint root: another
    job's save in progress would look like a crashed one.
    """
    root.mkdir(parents=True, exist_ok=True)
    recover(root)
    for stale in root.iterdir():
        if stale.name.startswith((TMP_PREFIX, _TRASH_PREFIX)):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
    checkpoint_id = uuid.uuid4().hex
    tmp = root / f"{TMP_PREFIX}{tag}-{checkpoint_id[:12]}"
    tmp.mkdir()
    return str(tmp), checkpoint_id


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, allow_nan=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` so a reader sees the old or the new content, never a mix."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def publish_dir(tmp: Path, final: Path) -> None:
    """Rename the finished temporary directory to its final name (replacing an older save of the tag).

    See [Note: re-saving a tag] for a crash between the two renames of a re-save.
    """
    fsync_dir(tmp)
    if final.exists():
        old = final.with_name(f"{_OLD_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(final.parent)  # the new directory is durable before the old one goes
        remove_dir(old)
    else:
        os.rename(tmp, final)
    fsync_dir(final.parent)


def recover(root: Path) -> list[str]:
    """Rank 0 (or one offline process): undo a re-save that crashed between its two renames.

    Restores each `.old-<name>-*` whose `<name>` is missing, deletes the others; returns the
    restored names. See [Note: re-saving a tag].
    """
    if not root.is_dir():
        return []
    restored = []
    for old in sorted(root.iterdir()):
        if not old.name.startswith(_OLD_PREFIX):
            continue
        name = old.name.removeprefix(_OLD_PREFIX).rpartition("-")[0]  # drop the "-<id>" suffix
        if not name:
            continue
        final = root / name
        if final.exists():
            remove_dir(old)
        else:
            os.rename(old, final)
            restored.append(name)
    if restored:
        fsync_dir(root)
    return restored


def remove_dir(path: Path) -> None:
    """Delete a checkpoint directory so a crash midway never leaves a half-deleted one under its name."""
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def read_pointer(root: Path, name: str) -> str:
    pointer = root / name
    if not pointer.is_file():
        raise ValueError(
            f"no checkpoint to resume in {root}: the {name!r} pointer file is missing (nothing was saved there, "
            "or every save crashed); pass tag= explicitly"
        )
    tag = pointer.read_text(encoding="utf-8").strip()
    check_tag(tag)
    return tag
