"""Checkpoints and the Hugging Face export, through `smp.save_checkpoint` / `smp.resume_from_checkpoint`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import shardpar as smp


def save(
    path: Path, tag: str, *, model: Any, optimizer: Any, user_content: Any, keep: int, background: bool = False
) -> Path:
    """A resumable (partial) checkpoint of the model and optimizer smp built; keeps the newest `keep`.
    `background`: an async save, committed by smp.poll_checkpoint() / smp.wait_for_checkpoint()."""
    smp.save_checkpoint(
        path,
        tag,
        partial=True,
        model=model,
        optimizer=optimizer,
        user_content=user_content,
        num_kept_partial_checkpoints=keep,
        async_save=background,
    )
    return path / f"{tag}_partial"


def commit(*, raise_errors: bool) -> str | None:
    """The pending background save, committed on every rank (`newest` moves); its error as text when
    `raise_errors` is off (the ranks agree on it), else None."""
    try:
        smp.wait_for_checkpoint()
    except Exception as err:
        if raise_errors:
            raise
        return f"{type(err).__name__}: {err}"
    return None


def resume(path: Path, tag: str) -> Any:
    """Load `tag` ("newest": the newest) into the model and optimizer smp built; its user_content."""
    # A missing tag is the facade's CheckpointError (naming the directory), after it restored a
    # re-save that crashed between its renames.
    if tag == "newest" and not (path / "newest").is_file():
        raise ValueError(f"--resume: no checkpoint under {path} yet (expected {path / 'newest'})")
    return smp.resume_from_checkpoint(path, None if tag == "newest" else tag, partial=True)


def restarted(path: Path) -> bool:
    """Collective: whether this start continues a run that died -- torchrun restarted it
    (TORCHELASTIC_RESTART_COUNT > 0), or some rank finds in-memory snapshots of `path` that a crash or a
    preemption left (a normal finish removes them). A fresh start of a finished run is not a restart."""
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    directory = smp.snapshot_directory(path)
    left = directory.is_dir() and any(directory.glob("rank*.snap"))
    return count > 0 or any(smp.allgather(left))


def resume_newest(path: Path) -> Any:
    """The newest complete state under `path`: an in-memory snapshot or the disk checkpoint, whichever is
    newer; its user_content, or None when there is none (smp.last_resume() says which was loaded)."""
    return smp.resume_from_checkpoint(path, partial=True, missing_ok=True)


def snapshot(path: Path, step: int, user_content: Any) -> str | None:
    """This rank's in-memory snapshot when `step` is a multiple of checkpoint_snapshot_interval (local)."""
    return smp.save_snapshot(path, step, user_content)


def export(path: Path, tag: str, *, model: Any) -> Path:
    """A consolidated Hugging Face directory `path/tag` (config.json + safetensors)."""
    smp.save_checkpoint(path, tag, partial=False, model=model)
    return path / tag
