"""A PEFT model's adapter entries at full size, without gathering its frozen base (issue 33).

PEFT's `save_pretrained` picks the adapter's entries from the module's state dict. Gathering the whole
state dict (full_views.py) would put every frozen base weight at full size on every rank -- the memory
LoRA exists to save -- so PEFT's own selection runs first on the parameters themselves
(`state_dict(keep_vars=True)`, no gather), and only the entries it picks are gathered (`full_tensor()`,
a collective in the same order on every rank). Used by the module's collective `save_pretrained`
(full_views.py) and by the Trainer front end (integrations/peft_export.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardpar.runtime.sharded_tensor import ShardedTensor


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
