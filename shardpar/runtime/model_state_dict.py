"""DistributedModel's state-dict surface: full tensors under the unwrapped model's keys on save and
load (runtime/state_dict.py does the gathering and scattering), the nested form a parent module's
state_dict / load_state_dict reaches, and SMP v1's local (partial) state dict.

A mixin, listed before nn.Module in DistributedModel's bases (runtime/model.py); it owns none of the
attributes it reads -- DistributedModel.__init__ sets them."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

from torch import nn
from torch.nn.modules.module import _IncompatibleKeys  # what nn.Module.load_state_dict returns

from shardpar.runtime.full_views import STATE_DICT_FIX
from shardpar.runtime.state import ShardedState
from shardpar.runtime.state_dict import (
    TPLayout,
    forget_inner_missing,
    load_full_state_dict,
    load_nested,
    local_param_shapes,
    nested_state_dict,
)

PARTIAL_KEY = "_smp_is_partial"  # SMP v1's marker of a local_state_dict()


class StateDictMixin(nn.Module):
    """state_dict / load_state_dict (full, nested, and SMP v1's local form) of a DistributedModel."""

    # Set by DistributedModel.__init__ (runtime/model.py).
    module: nn.Module
    sharded_state: ShardedState
    _tp: TPLayout | None
    _nested_prefix: str | None  # set while a parent's load_state_dict passes through

    def gathering(self, name: str, fix: str) -> AbstractContextManager[None]:
        """DistributedModel's check-in around a gathering call ([Note: collective entry])."""
        raise NotImplementedError

    def state_dict(  # type: ignore[override]
        self, *args: Any, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """Full tensors under the unwrapped model's keys (gathered unit by unit), each after `prefix`;
        written into `destination` when given, as nn.Module does when this model is another's child.
        With `keep_vars` buffers are the module's own tensors; parameters are full fp32 copies
        whatever `keep_vars` says (a sharded parameter has no full tensor to hand out)."""
        if len(args) > 3:
            raise TypeError(f"state_dict() takes at most 3 positional arguments ({len(args)} given)")
        # nn.Module's deprecated positional form: (destination, prefix, keep_vars)
        destination = args[0] if len(args) > 0 else destination
        prefix = args[1] if len(args) > 1 else prefix
        keep_vars = args[2] if len(args) > 2 else keep_vars
        with self.gathering("model.state_dict()", STATE_DICT_FIX):
            return nested_state_dict(
                self.sharded_state, self.module, destination, prefix, keep_vars=keep_vars, tp=self._tp
            )

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load full tensors (as returned by `state_dict`) into the shards and persistent params; a
        missing key (strict) or a tensor of another shape raises before anything is written.

        `assign=True` raises ValueError: the parameters are views of their unit's shards, so the
        values are always copied in, never adopted."""
        if state_dict.get(PARTIAL_KEY):  # SMP v1: smp.save(model.local_state_dict()), then load it back
            self.sharded_state.load_local_state_dict({k: v for k, v in state_dict.items() if k != PARTIAL_KEY})
            return _IncompatibleKeys([], [])
        if assign:
            raise ValueError(
                "load_state_dict(assign=True) is not supported by a DistributedModel: its parameters are "
                "views of the sharded fp32 main copy, so the values are copied in, not adopted; pass assign=False"
            )
        return load_full_state_dict(self.sharded_state, self.module, self._tp_local(state_dict), strict)

    def _tp_local(self, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
        """Under tensor parallelism: this TP rank's piece of each full (Hugging Face layout) tensor."""
        if self._tp is None:
            return state_dict
        return self._tp.local(state_dict, local_param_shapes(self.sharded_state, self.module))

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """A parent's load_state_dict reaching this model: load the keys under `prefix` (the unwrapped
        model's keys, as `state_dict(prefix=...)` writes them) into the shards, and report missing and
        unexpected ones and errors as nn.Module does. torch then recurses into `self.module`, whose
        parameters are size-0 views outside forward and whose keys (`<prefix>module.*`) the dict never
        holds: `_forget_inner_missing` takes those from the missing keys afterwards."""
        mine = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        local = {prefix + k: v for k, v in self._tp_local(mine).items()}
        if load_nested(self.sharded_state, self.module, local, prefix, missing_keys, unexpected_keys, error_msgs):
            self._nested_prefix = prefix

    @staticmethod
    def _forget_inner_missing(model: StateDictMixin, incompatible: Any) -> None:
        prefix = model._nested_prefix
        if prefix is None:
            return
        forget_inner_missing(prefix, incompatible.missing_keys)
        model._nested_prefix = None

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's shard of every sharded parameter (1-D) and every persistent parameter, with SMP
        v1's `_smp_is_partial: True`, by which `load_state_dict` takes it back (same topology)."""
        return {**self.sharded_state.local_state_dict(), PARTIAL_KEY: True}
