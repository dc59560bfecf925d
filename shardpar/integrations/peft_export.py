"""A PEFT model's adapter, saved and loaded as PEFT does it, from a DistributedModel that wraps a
`PeftModel` -- what transformers' Trainer writes for one: `adapter_model.safetensors` +
`adapter_config.json` (PeftModel.save_pretrained), not the base model's weights under PEFT's keys with
a `PeftModel` config, which `from_pretrained` cannot load.

PEFT's `save_pretrained` picks the adapter's entries from the module's state dict. Gathering the whole
state dict (runtime/full_views.py) would put every frozen base weight at full size on every rank -- the
memory LoRA exists to save -- so PEFT's own selection runs first on the parameters themselves
(`state_dict(keep_vars=True)`, no gather), and only the entries it picks are gathered
(`full_tensor()`, a collective in the same order on every rank) and handed to `save_pretrained`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from shardpar.runtime.model import DistributedModel
from shardpar.runtime.sharded_tensor import ShardedTensor

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def is_peft_model(module: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # without peft installed no model is one
        return False
    return isinstance(module, PeftModel)


def adapter_state_dict(module: Any) -> dict[str, Any]:
    """The entries of `module.state_dict()` that PEFT saves for its adapters, at full size (a collective).
    Falls back to the whole gathered state dict where PEFT's selection builds new tensors (then no
    entry can be traced back to a parameter)."""
    from peft import get_peft_model_state_dict

    held = module.state_dict(keep_vars=True)  # the parameters themselves: nothing gathered
    picked: set[int] = set()
    for name in module.peft_config:
        chosen = get_peft_model_state_dict(module, state_dict=held, adapter_name=name)
        picked.update(id(v) for v in chosen.values())
    by_id = {id(v): k for k, v in held.items()}
    if not picked <= by_id.keys():
        full: dict[str, Any] = module.state_dict()
        return full
    out: dict[str, Any] = {}
    for key, value in held.items():
        if id(value) in picked:
            out[key] = value.full_tensor() if isinstance(value, ShardedTensor) else value.detach()
    return out


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
