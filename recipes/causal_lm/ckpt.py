"""Checkpoints and the Hugging Face export, through `smp.save_checkpoint` / `smp.resume_from_checkpoint`.

Uses the facade when it has them, else `shardpar.checkpoint` with the facade's topology and engine.
Where neither exists (a build without checkpointing), saving and exporting print why and carry on,
and `--resume` stops with a clear error rather than silently starting from scratch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import shardpar as smp


def _functions() -> tuple[Callable[..., Any], Callable[..., Any]] | str:
    """(save, resume) as save(path, tag, *, model, optimizer, ...) and resume(path, tag, *, model,
    optimizer, partial), or why there are none."""
    if hasattr(smp, "save_checkpoint") and hasattr(smp, "resume_from_checkpoint"):

        def facade_resume(path: Any, tag: str | None, *, model: Any, optimizer: Any, partial: bool) -> Any:
            del model, optimizer  # the facade resumes the model and optimizer smp built last: ours
            return smp.resume_from_checkpoint(path, tag, partial=partial)

        return smp.save_checkpoint, facade_resume
    try:
        from shardpar import checkpoint as ck
    except ImportError as err:
        return f"this shardpar build has no checkpoint support ({err})"

    def save(path: Any, tag: str, **kwargs: Any) -> Any:
        return ck.save_checkpoint(path, tag, topology=smp.get_topology(), engine=smp.get_engine(), **kwargs)

    def resume(path: Any, tag: str | None, **kwargs: Any) -> Any:
        return ck.resume_from_checkpoint(path, tag, topology=smp.get_topology(), engine=smp.get_engine(), **kwargs)

    return save, resume


def unavailable_reason() -> str | None:
    fns = _functions()
    return fns if isinstance(fns, str) else None


def save(path: Path, tag: str, *, model: Any, optimizer: Any, user_content: Any, keep: int) -> Path | None:
    """A resumable (partial) checkpoint; None (and nothing written) when checkpointing is missing."""
    fns = _functions()
    if isinstance(fns, str):
        return None
    out = fns[0](
        path,
        tag,
        partial=True,
        model=model,
        optimizer=optimizer,
        user_content=user_content,
        num_kept_partial_checkpoints=keep,
    )
    return Path(out) if out is not None else path / f"{tag}_partial"


def resume(path: Path, tag: str, *, model: Any, optimizer: Any) -> Any:
    """Load `tag` ("newest": the newest) into model and optimizer; its user_content."""
    fns = _functions()
    if isinstance(fns, str):
        raise ValueError(f"--resume: {fns}; run without --resume")
    if tag != "newest" and not (path / f"{tag}_partial").is_dir():
        raise ValueError(f"--resume {tag}: no checkpoint {path / (tag + '_partial')}")
    if tag == "newest" and not (path / "newest").is_file():
        raise ValueError(f"--resume: no checkpoint under {path} yet (expected {path / 'newest'})")
    return fns[1](path, None if tag == "newest" else tag, partial=True, model=model, optimizer=optimizer)


def export(path: Path, tag: str, *, model: Any) -> Path | None:
    """A consolidated Hugging Face directory `path/tag` (config.json + safetensors); None if unsupported."""
    fns = _functions()
    if isinstance(fns, str):
        return None
    out = fns[0](path, tag, partial=False, model=model)
    return Path(out) if out is not None else path / tag
