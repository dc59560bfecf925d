"""A PEFT model's adapter, saved and loaded as PEFT does it, from a DistributedModel that wraps a
`PeftModel` -- what transformers' Trainer writes for one: `adapter_model.safetensors` +
`adapter_config.json` (PeftModel.save_pretrained), not the base model's weights under PEFT's keys with
a `PeftModel` config, which `from_pretrained` cannot load.

Only the adapter's entries are gathered, never the frozen base (runtime/peft_state.py, which the
module's own collective `save_pretrained` uses too).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from shardpar.runtime.model import DistributedModel
from shardpar.runtime.peft_state import adapter_state_dict, is_peft_model

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
__all__ = ["ADAPTER_FILES", "adapter_state_dict", "is_peft_model", "load_adapter", "save_adapter"]


def save_adapter(model: DistributedModel, directory: str | os.PathLike[str], *, is_main_process: bool = True) -> None:
    """`PeftModel.save_pretrained(directory)` with full adapter weights; every rank calls it, rank 0
    writes (the module's save_pretrained is the collective form, full_views.py)."""
    module: Any = model.module
    module.save_pretrained(directory, state_dict=adapter_state_dict(module), is_main_process=is_main_process)
    # with a state_dict given save_pretrained is no collective: the files are in place before any rank reads them
    model.engine.barrier(model.topology.group("world"))


def load_adapter(model: DistributedModel, directory: str | os.PathLike[str]) -> None:
    """The adapter weights PEFT saved in `directory` into the active adapter's (sharded) parameters:
    each rank copies in its own piece (ShardedTensor's copy_ of a full tensor)."""
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    module: Any = model.module
    weights = load_peft_weights(str(directory), device="cpu")
    with torch.no_grad():
        result: Any = set_peft_model_state_dict(module, weights, adapter_name=module.active_adapter)
    if result.unexpected_keys:
        raise ValueError(
            f"{directory}: adapter weights {result.unexpected_keys[:3]} match no parameter of the PEFT model; "
            "resume with the same LoraConfig (target_modules, r) the checkpoint was trained with"
        )
