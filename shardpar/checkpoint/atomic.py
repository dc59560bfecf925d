"""Crash-safe directories and rank agreement for checkpoints.

[Note: atomic checkpoints]
A save writes into `<root>/.tmp-<tag>-<id>/`. Only after every rank reported its files written
(one all-gather, which doubles as the "everyone finished" barrier) does rank 0 write the index,
rename the directory to its final name and then move the `newest` pointer (write a temporary file,
fsync, os.replace). A crash at any point before the rename leaves only a `.tmp-*` directory, which
the next save or resume removes ([Note: stale temporary entries]); the previous checkpoint and the
pointer are untouched. Every phase runs "locally, then agree": a rank that fails reports its error
instead of leaving the collective, so the others raise the same error instead of waiting; a rank
that dies makes the collective fail within the process group's timeout (collective_timeout_s).

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

import contextlib
import enum
import fcntl
import json
import os
import shutil
import time
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


@dataclass
class TmpDir:
    """A save's temporary directory and the lock that marks it in flight ([Note: stale temporary entries])."""

    path: Path
    checkpoint_id: str
    fd: int | None  # holds flock(LOCK_EX) on the directory itself; None where the filesystem cannot lock

    def release(self) -> None:
        """Let the next sweep treat the directory as abandoned (a dead process releases it the same way)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> TmpDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def make_tmp_dir(root: Path, tag: str) -> TmpDir:
    """Rank 0: clear what crashed saves left behind (`sweep`), create a fresh temporary directory, held
    locked until `release` (at the end of the save, or by the process's death)."""
    root.mkdir(parents=True, exist_ok=True)
    sweep(root)
    checkpoint_id = uuid.uuid4().hex
    tmp = root / f"{TMP_PREFIX}{tag}-{checkpoint_id[:12]}"
    tmp.mkdir()
    state, fd = _try_lock(tmp)
    if state in (Lock.HELD_ELSEWHERE, Lock.GONE):
        raise OSError(f"{tmp}: another process removed or locked this new temporary directory; save again")
    return TmpDir(tmp, checkpoint_id, fd)


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
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    with open(fd, "w", encoding="utf-8") as f:
        with contextlib.suppress(OSError):  # in flight until replaced; unlockable: the sweep goes by age
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
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
            continue
        try:
            os.rename(old, final)
        except FileNotFoundError:
            continue  # another process recovered it first
        restored.append(name)
    if restored:
        fsync_dir(root)
    return restored


def remove_dir(path: Path) -> None:
    """Delete a checkpoint directory so a crash midway never leaves a half-deleted one under its name."""
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return  # already gone (another process removed it)
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


# ---- stale temporary entries ---------------------------------------------------------------------

# [Note: stale temporary entries]
# A crashed save leaves `.tmp-<tag>-<id>/` (its files so far) and possibly `.tmp-newest-<id>` (a
# pointer not yet moved into place). `sweep` (rank 0, first thing in every save and every resume)
# removes them, but never one that is in flight. In flight is decided by a lock, not by job ids or
# ages: the save holds flock(LOCK_EX) on its temporary directory (on the pointer file while it is
# written) from creation until it is published or removed, and the kernel drops that lock when the
# process dies, however it dies. The sweep tries the same lock without waiting:
#
#     got it            nobody owns the entry: a crash (or a pre-lock shardpar) left it  -> removed
#     held elsewhere    a save of another job (or process) is writing it                  -> kept
#     cannot lock       (some NFS / Lustre mounts)  -> removed only when nothing in it changed for
#                       STALE_AFTER_S: a live save's files keep changing (every rank streams into
#                       them) or the save ends within collective_timeout_s
#
# Ids were not enough: after a restart every earlier id is "not ours" yet may belong to a second job
# still saving; ages alone would keep a crash's leftovers for the whole grace period. `.old-*`
# (re-saves, [Note: re-saving a tag]) are recovered only while no entry is held: a save in flight
# elsewhere may sit between its two renames, where its `.old-*` is legitimately the only copy.
# `.trash-*` are removed always (concurrent deletions of one directory are harmless).
STALE_AFTER_S = 3600.0


def sweep(root: Path, *, now: float | None = None) -> list[str]:
    """Rank 0 (or one offline process): recover `.old-*` and remove stale `.tmp-*` / `.trash-*` entries
    of `root` ([Note: stale temporary entries]); the names removed or restored."""
    if not root.is_dir():
        return []
    now = time.time() if now is None else now
    done: list[str] = []
    in_flight = False
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(_TRASH_PREFIX):
            _delete(entry)
            done.append(entry.name)
        elif entry.name.startswith(TMP_PREFIX):
            state, fd = _try_lock(entry)
            in_flight |= state is Lock.HELD_ELSEWHERE
            try:
                if state is Lock.GOT or (state is Lock.UNKNOWN and now - _last_change(entry) > STALE_AFTER_S):
                    _delete(entry)
                    done.append(entry.name)
            finally:
                if fd is not None:
                    os.close(fd)
    if not in_flight:
        done += recover(root)
    return done


class Lock(enum.Enum):
    GOT = "got"  # the caller now holds it (the fd returned with it)
    HELD_ELSEWHERE = "held elsewhere"  # another open file holds it: in flight
    GONE = "gone"  # someone else removed the entry meanwhile
    UNKNOWN = "unknown"  # this filesystem cannot lock


def _try_lock(path: Path) -> tuple[Lock, int | None]:
    """Try flock(LOCK_EX) on `path` without waiting; with Lock.GOT, the fd that holds it."""
    try:
        fd = os.open(path, os.O_RDONLY if path.is_dir() else os.O_RDWR)
    except FileNotFoundError:
        return Lock.GONE, None
    except OSError:
        return Lock.UNKNOWN, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return Lock.HELD_ELSEWHERE, None
    except OSError:
        os.close(fd)
        return Lock.UNKNOWN, None
    return Lock.GOT, fd


def _last_change(path: Path) -> float:
    """The newest mtime of `path` and what it directly holds (a save's files grow while it writes)."""
    try:
        times = [path.stat().st_mtime]
        if path.is_dir():
            times += [child.stat().st_mtime for child in path.iterdir()]
    except FileNotFoundError:
        return 0.0
    return max(times)


def _delete(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
