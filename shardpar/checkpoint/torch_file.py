"""A full model saved with `torch.save(model.state_dict(), path)` -- what SMP v1's templates write for
`--fine_tune` (`fullmodel.pt`) and read back with `smp.resume_from_checkpoint(dir, tag="fullmodel.pt",
partial=False)`. Read weights-only (`torch.load(weights_only=True)`): tensors and plain containers come
back, and a file that would need to run code to unpickle is refused, never executed."""

from __future__ import annotations

import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from shardpar.runtime.model import DistributedModel

# Where a state dict may sit inside a saved dict (a bare state dict is used as it is).
_WRAPPERS = ("state_dict", "model", "module")


def load_torch_file(file: Path, model: DistributedModel, strict: bool) -> None:
    """Load the state dict in `file` into `model` (every rank reads the file; no collective)."""
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as e:
        # torch's own message suggests weights_only=False; only the object it refused is worth repeating
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        what = f"a {found.group(1)} object" if found else "an object torch's weights-only loader refuses"
        raise ValueError(
            f"smp.resume_from_checkpoint(partial=False): {file} is a torch.save file that holds more than tensors "
            f"and plain containers ({what}); it is read weights-only, so no code in it runs. Save the model with "
            "torch.save(model.state_dict(), path), or as a Hugging Face directory (save_pretrained / "
            "smp.save_checkpoint(partial=False))"
        ) from e
    state = _state_dict(saved, file)
    model.load_state_dict(state, strict=strict)


def _state_dict(saved: Any, file: Path) -> Mapping[str, torch.Tensor]:
    if isinstance(saved, Mapping) and saved and all(isinstance(v, torch.Tensor) for v in saved.values()):
        return saved
    if isinstance(saved, Mapping):
        for key in _WRAPPERS:
            inner = saved.get(key)
            if isinstance(inner, Mapping) and all(isinstance(v, torch.Tensor) for v in inner.values()):
                return inner
    kinds = sorted({type(v).__name__ for v in saved.values()}) if isinstance(saved, Mapping) else [type(saved).__name__]
    raise ValueError(
        f"smp.resume_from_checkpoint(partial=False): {file} holds {kinds}, not a state dict of tensors (nor one "
        f"under {list(_WRAPPERS)}); save it with torch.save(model.state_dict(), path)"
    )
