"""What the wrapped module's own `state_dict()` and `save_pretrained()` give: full values.

Outside forward the module holds the user parameters, ShardedTensors with this rank's piece only
(runtime/user_params.py). Code that saves a model through the module itself -- transformers'
`save_pretrained`, PEFT's adapter `save_pretrained` (both call `self.state_dict()`), a plain
`torch.save(model.module.state_dict())` -- must get the full tensors, in the Hugging Face layout under
tensor parallelism, or it writes pieces (issue 20: every tensor of shape [0], a lost run). So:

  * `module.state_dict()` (keep_vars=False, from the module itself) replaces every ShardedTensor by the
    full value, gathered unit by unit over the sharding group (and the TP group): a collective, so every
    rank calls it, as with `model.state_dict()`. `keep_vars=True` keeps the parameters themselves
    (that is what it asks for; shardpar's own code reads the module that way and gathers nothing);
  * `module.save_pretrained(...)` (also reached as `model.save_pretrained`) gathers that state dict on
    every rank, lets rank 0 alone write (`is_main_process`), and returns on every rank once the files
    are there (a barrier). transformers already writes from rank 0 only; PEFT would let every rank write
    the same files at once. Called on some ranks only it raises there ([Note: collective entry]).
    With a `state_dict=` given there is nothing to gather: rank 0 writes it, no collective, as plain
    transformers does (its SMP branch calls it on rank 0 alone with the gathered state dict). A PEFT
    model's gathers only its adapter's entries, never the frozen base (peft_state.py): PEFT writes
    those alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from shardpar.runtime.peft_state import adapter_state_dict, is_peft_model
from shardpar.runtime.sharded_tensor import ShardedTensor
from shardpar.runtime.state_dict import TPLayout

# [Note: collective entry] (collectives/entry.py): the model's check-in around a gathering call
Gathering = Callable[[str, str], AbstractContextManager[None]]
STATE_DICT_FIX = (
    "Call it on every rank and keep only rank 0's result where only rank 0 saves: "
    "`sd = model.state_dict()` then `if smp.rank() == 0: torch.save(sd, path)`."
)
SAVE_PRETRAINED_FIX = (
    "Call save_pretrained on every rank (drop the `if smp.rank() == 0:` around it): shardpar gathers the weights "
    "on every rank and writes the files from rank 0 alone."
)


class FullStateDictHooks:
    """Makes `module.state_dict()` hold full tensors (see the module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        full_values: Callable[[], dict[str, torch.Tensor]],
        tp: TPLayout | None,
        gathering: Gathering,
    ) -> None:
        self._full_values = full_values
        self._tp = tp
        self._gathering = gathering
        self._keep_vars: list[bool] = []
        # plain functions: torch marks a post-hook with an attribute, which a bound method cannot take
        self.handles = [
            module.register_state_dict_pre_hook(lambda m, prefix, keep_vars: self._pre(m, prefix, keep_vars)),
            module.register_state_dict_post_hook(lambda m, sd, prefix, meta: self._post(m, sd, prefix, meta)),
        ]

    def _pre(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self._keep_vars.append(keep_vars)

    def _post(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        keep_vars = self._keep_vars.pop() if self._keep_vars else True
        if keep_vars:
            return
        sharded = {k: v for k, v in state_dict.items() if k.startswith(prefix) and isinstance(v, ShardedTensor)}
        if not sharded:
            return
        with self._gathering("model.module.state_dict()", STATE_DICT_FIX):
            values = self._full_values()  # by piece name; a tied parameter's names share one tensor
            full = {k[len(prefix) :]: values[v.shard_layout.fqn] for k, v in sharded.items()}
            if self._tp is not None:
                gathered: dict[int, torch.Tensor] = {}  # tied names: gather once, keep one tensor
                for key in full:
                    source = full[key]
                    if id(source) not in gathered:
                        gathered[id(source)] = self._tp.gather({key: source})[key]
                    full[key] = gathered[id(source)]
        for key, value in full.items():
            state_dict[prefix + key] = value


def wrap_save_pretrained(
    module: nn.Module, *, is_rank0: bool, barrier: Callable[[], None], gathering: Gathering
) -> None:
    """Replace `module.save_pretrained` (when it has one) by the collective form of the module docstring."""
    original = getattr(module, "save_pretrained", None)
    if original is None or not callable(original) or getattr(original, "_shardpar_collective", False):
        return

    @functools.wraps(original)
    def save_pretrained(save_directory: Any, *args: Any, is_main_process: bool = True, **kwargs: Any) -> Any:
        main = bool(is_main_process) and is_rank0
        if kwargs.get("state_dict") is not None:
            # Nothing to gather: plain transformers' behaviour, no collective. transformers' own SMP branch
            # gathers model_wrapped.state_dict() on every rank, then calls this on rank 0 alone.
            return original(save_directory, *args, is_main_process=main, **kwargs)
        with gathering("save_pretrained()", SAVE_PRETRAINED_FIX):
            # full, gathered on every rank; a PEFT model's adapter entries alone
            kwargs["state_dict"] = adapter_state_dict(module) if is_peft_model(module) else module.state_dict()
            try:
                return original(save_directory, *args, is_main_process=main, **kwargs)
            finally:
                barrier()

    save_pretrained._shardpar_collective = True  # type: ignore[attr-defined]
    object.__setattr__(module, "save_pretrained", save_pretrained)  # an instance attribute, shadowing the method
