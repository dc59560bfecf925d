"""The sharded state dicts of torch.distributed.checkpoint.state_dict (`full_state_dict=False`, FSDP2's
default) for a DistributedModel and its optimizer: every parameter and per-element optimizer state
as a ShardedTensor aliasing this rank's piece -- what FSDP2 gives as DTensors -- so that

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)      # or dcp.load(...)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

writes each element once and loads each rank's own elements in place, with no whole parameter on any
rank (runtime/dcp_chunks.py says how DCP sees the pieces). The keys are the unwrapped model's FQNs,
as FSDP2's, so a checkpoint moves between an FSDP2 job and shardpar at any world size and sdp.

Loading: `set_*` take ShardedTensors of the same placement by their local pieces (a no-op copy when DCP
already loaded into the aliases), others through `full_tensor()` (a collective), and plain full
tensors as torch_state_dict.py takes them. Persistent tensors are whole on every rank but DCP reads
each rank's row block only, so `set_*` first gathers the other rows over the sharding group
(dcp_persistent.py; one collective per dtype): after `dcp.load`, call `set_state_dict`, as FSDP2's
recipe does."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from shardpar.checkpoint import dcp_persistent
from shardpar.runtime.model import DistributedModel
from shardpar.runtime.shard_layout import ShardLayout
from shardpar.runtime.sharded_tensor import ShardedTensor
from shardpar.runtime.state_dict import param_aliases


def same_placement(a: ShardLayout, b: ShardLayout) -> bool:
    """Whether two layouts put the same elements of the same tensor on this rank."""
    return (
        tuple(a.shape) == tuple(b.shape)
        and a.sharded == b.sharded
        and (not a.sharded or (a.start, a.length) == (b.start, b.length))
        and a.tp is None
        and b.tp is None
    )


def sharded(local: torch.Tensor, layout: ShardLayout, *, cpu: bool) -> ShardedTensor:
    """A ShardedTensor over `local` (an alias; a CPU copy with `cpu_offload` off the CPU)."""
    if cpu and local.device.type != "cpu":
        local = local.detach().to("cpu")
    return ShardedTensor(local.detach(), layout)


# ---- the model --------------------------------------------------------------------------------


def model_state_dict(model: DistributedModel, *, ignore_frozen_params: bool, cpu: bool) -> dict[str, Any]:
    """FQN -> ShardedTensor for the parameters (tied ones under each name, one object), buffers as
    `model.state_dict()` gives them (cloned). No collective."""
    state = model.sharded_state
    state.will_write("get_model_state_dict()")  # views that dcp.load writes into: no async staging copy reads them
    out: dict[str, Any] = {}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad} if ignore_frozen_params else set()
    made: dict[int, ShardedTensor] = {}
    for key, value in model.module.state_dict(keep_vars=True).items():
        if key in frozen:
            continue
        piece = state.piece_of(value)
        if piece is None:
            out[key] = value.detach().to("cpu") if cpu else value.detach().clone()
            continue
        user = state.user_of(piece)
        if not isinstance(user, ShardedTensor):
            raise AssertionError(f"{key}: no sharded parameter behind it")
        if id(user) not in made:
            made[id(user)] = sharded(user.local_piece, user.shard_layout, cpu=cpu)
        out[key] = made[id(user)]
    return out


def split_sharded(model: DistributedModel, state_dict: Mapping[str, Any], strict: bool) -> dict[str, Any]:
    """Load the ShardedTensor values of `state_dict` into the model; return the rest (plain tensors) for
    `load_state_dict`. The key checks of `load_state_dict(strict=True)` run first, on the whole dict,
    before anything is written (every rank passes the same keys)."""
    if not any(isinstance(v, ShardedTensor) for v in state_dict.values()):
        return dict(state_dict)
    module, state = model.module, model.sharded_state
    names = list(module.state_dict(keep_vars=True))
    by_name = {n: p for n, p in module.state_dict(keep_vars=True).items()}
    if strict:
        aliases = param_aliases(module)
        absent = [
            n
            for n in names
            if n not in state_dict and not any(a in state_dict for a in aliases.get(id(by_name[n]), [n]))
        ]
        unexpected = [k for k in state_dict if k not in by_name]
        if absent or unexpected:
            raise ValueError(
                f"set_model_state_dict: missing keys {absent[:4]}, unexpected keys {unexpected[:4]} in a sharded "
                "state dict; load a state dict of this model's architecture, or pass StateDictOptions(strict=False)"
            )
    rest: dict[str, Any] = {}
    written = False
    state.will_write("set_model_state_dict()")
    with torch.no_grad():
        dcp_persistent.complete(state_dict.values(), state.device)  # rows other ranks read (a collective)
        for key, value in state_dict.items():
            piece = state.piece_of(by_name[key]) if key in by_name else None
            if not isinstance(value, ShardedTensor) or piece is None:
                rest[key] = value.full_tensor() if isinstance(value, ShardedTensor) else value
                continue
            user = state.user_of(piece)
            if not isinstance(user, ShardedTensor):
                raise AssertionError(f"set_model_state_dict: the user parameter of {key} is not a ShardedTensor")
            if tuple(value.shape) != tuple(user.shape):
                raise ValueError(
                    f"set_model_state_dict: {key} has shape {list(value.shape)} in the state dict, "
                    f"{list(user.shape)} in the model; load a state dict of this model's architecture"
                )
            if not same_placement(value.shard_layout, user.shard_layout):
                rest[key] = value.full_tensor()  # another placement: gather (a collective, alike on every rank)
                continue
            if value.local_piece.data_ptr() != user.local_piece.data_ptr():
                user.local_piece.copy_(value.local_piece)
            written = True
    if written:
        state.mark_written()  # the compute copies (and other replicas' pieces) refresh before the next forward
    return rest


# ---- the optimizer ----------------------------------------------------------------------------


def is_alias(value: Any, live: Any) -> bool:
    """Whether a sharded state value is a view of exactly the optimizer's live state tensor `live`."""
    if not isinstance(value, ShardedTensor) or not isinstance(live, torch.Tensor) or live.dim() == 0:
        return False
    mine = live.local_piece if isinstance(live, ShardedTensor) else live
    piece = value.local_piece
    return bool(piece.data_ptr() == mine.data_ptr() and piece.numel() == mine.numel() and piece.dtype == mine.dtype)


def state_piece(value: Any, layout: ShardLayout, fqn: str) -> torch.Tensor | None:
    """This rank's piece of a ShardedTensor state value when its placement is ours, else None."""
    if isinstance(value, ShardedTensor) and same_placement(value.shard_layout, layout):
        return value.local_piece.detach().clone().reshape(-1 if layout.sharded else layout.local_shape)
    return None
