"""Checkpoints and the Hugging Face export, through `smp.save_checkpoint` / `smp.resume_from_checkpoint`."""

from __future__ import annotations

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


def export(path: Path, tag: str, *, model: Any) -> Path:
    """A consolidated Hugging Face directory `path/tag` (config.json + safetensors)."""
    smp.save_checkpoint(path, tag, partial=False, model=model)
    return path / tag
