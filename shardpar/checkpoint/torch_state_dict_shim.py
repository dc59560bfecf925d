"""The shim in front of torch.distributed.checkpoint.state_dict's four private helpers (`install()`,
called when a model is wrapped): a DistributedModel goes to torch_state_dict.py's functions, with
StateDictOptions read as torch reads them; any other model to torch's own code, unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint.state_dict as dsd
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys  # what nn.Module.load_state_dict returns

from shardpar.checkpoint import dcp_state_dict
from shardpar.checkpoint.torch_state_dict import (
    GROUPS,
    STATE,
    load_optimizer_state_dict,
    model_state_dict,
    optimizer_state_dict,
)
from shardpar.runtime.model import DistributedModel
from shardpar.runtime.sharded_tensor import ShardedTensor


def _refuse(info: Any, call: str) -> None:
    """Options of StateDictOptions (and get_*'s `submodules`) that have no meaning here."""
    if info.broadcast_from_rank0:
        raise ValueError(
            f"{call} with StateDictOptions(broadcast_from_rank0=True) on a shardpar DistributedModel: there is no "
            "DTensor to scatter into. Load the full state dict on every rank (full_state_dict=True without "
            "broadcast_from_rank0), or a Hugging Face directory with "
            "smp.resume_from_checkpoint(path, tag, partial=False)"
        )
    if info.submodule_prefixes:
        raise ValueError(
            f"{call}(submodules=...) on a shardpar DistributedModel: torch deprecated it; take the whole state dict "
            "and keep the keys under the submodule's prefix"
        )


def _unwrap_model(model: nn.Module) -> DistributedModel | None:
    return model if isinstance(model, DistributedModel) else None


def _offload(tensors: dict[str, Any], info: Any) -> dict[str, Any]:
    """`cpu_offload`: on the CPU; with `full_state_dict` rank 0 alone keeps them (torch's _gather_state_dict)."""
    if not info.cpu_offload:
        return tensors
    if not info.full_state_dict:  # sharded: each rank's pieces, on the CPU
        return _pieces_to_cpu(tensors)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return {}
    return dsd._offload_state_dict_to_cpu(tensors)


def _pieces_to_cpu(value: Any) -> Any:
    if isinstance(value, ShardedTensor):
        return dcp_state_dict.sharded(value.local_piece, value.shard_layout, cpu=True)
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    if isinstance(value, dict):
        return {k: _pieces_to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_pieces_to_cpu(v) for v in value]
    return value


def _get_model(original: Callable[..., Any], model: nn.Module, info: Any) -> Any:
    ours = _unwrap_model(model)
    if ours is None or not info.handle_model:
        return original(model, info)
    _refuse(info, "get_model_state_dict")
    if not info.full_state_dict:  # FSDP2's default: sharded, for torch.distributed.checkpoint
        return dcp_state_dict.model_state_dict(
            ours, ignore_frozen_params=info.ignore_frozen_params, cpu=info.cpu_offload
        )
    return _offload(model_state_dict(ours, ignore_frozen_params=info.ignore_frozen_params), info)


def _load_model(original: Callable[..., Any], model: nn.Module, state_dict: dict[str, Any], info: Any) -> Any:
    ours = _unwrap_model(model)
    if ours is None or not info.handle_model:
        return original(model, state_dict, info)
    _refuse(info, "set_model_state_dict")
    if not state_dict:  # torch: nothing to load
        return original(model, state_dict, info)
    rest = dcp_state_dict.split_sharded(ours, state_dict, info.strict)
    if len(rest) < len(state_dict):  # the sharded values are in; the key checks ran on the whole dict
        # nothing else to load: skip load_state_dict, which would refresh every unit for no values
        return ours.load_state_dict(rest, strict=False) if rest else _IncompatibleKeys([], [])
    return ours.load_state_dict(state_dict, strict=info.strict)


def _get_optim(original: Callable[..., Any], model: nn.Module, optimizers: Any, info: Any) -> Any:
    ours = _unwrap_model(model)
    if ours is None or not info.handle_optim:
        return original(model, optimizers, info)
    _refuse(info, "get_optimizer_state_dict")
    merged: dict[str, Any] = {STATE: {}, GROUPS: []}
    for optimizer in optimizers:
        one = optimizer_state_dict(ours, optimizer, full=info.full_state_dict)
        merged[STATE].update(one[STATE])
        merged[GROUPS].extend(one[GROUPS])
    if info.flatten_optimizer_state_dict:
        merged = dsd._flatten_optim_state_dict(merged)
    return _offload(merged, info)


def _load_optim(original: Callable[..., Any], model: nn.Module, optimizers: Any, state_dict: Any, info: Any) -> Any:
    ours = _unwrap_model(model)
    if ours is None or not info.handle_optim:
        return original(model, optimizers, state_dict, info)
    _refuse(info, "set_optimizer_state_dict")
    if len(optimizers) != 1:
        raise ValueError(
            f"set_optimizer_state_dict with {len(optimizers)} optimizers on a shardpar DistributedModel: one "
            "smp.DistributedOptimizer trains it; load each optimizer's own state dict with one call each"
        )
    load_optimizer_state_dict(ours, optimizers[0], state_dict, strict=info.strict)
    return None


_HELPERS: dict[str, Callable[..., Any]] = {
    "_get_model_state_dict": _get_model,
    "_load_model_state_dict": _load_model,
    "_get_optim_state_dict": _get_optim,
    "_load_optim_state_dict": _load_optim,
}


def install() -> None:
    """Put the shims in front of torch's helpers (once; idempotent). See the module docstring."""
    for name, ours in _HELPERS.items():
        original = getattr(dsd, name, None)
        if original is None:
            raise AssertionError(f"torch.distributed.checkpoint.state_dict.{name} is gone: update shardpar's shim")
        if getattr(original, "_shardpar_shim", False):
            continue

        @torch.no_grad()  # as torch's helpers are
        def shim(*args: Any, _ours: Callable[..., Any] = ours, _original: Any = original, **kwargs: Any) -> Any:
            return _ours(_original, *args, **kwargs)

        shim._shardpar_shim = True  # type: ignore[attr-defined]
        setattr(dsd, name, shim)
