"""torch.distributed.checkpoint.state_dict's functions on a DistributedModel and its optimizer:
`get_model_state_dict`, `get_optimizer_state_dict`, `get_state_dict` and their `set_*` return and take
what they return and take for FSDP2 -- tensors under the unwrapped model's FQNs, optimizer state keyed
by FQN, sharded by default and full with `full_state_dict=True` (docs/migration.md, "From PyTorch FSDP2").

Why not through torch's own code path: it maps optimizer state to FQNs by the identity of the tensors
in the optimizer's param groups, found again in `model.named_parameters()`; a DistributedOptimizer
steps plain leaves aliasing this rank's pieces of the main shards (optim/optimizer.py), which no module
holds (torch ends in a bare `KeyError: 0`), and its state tensors are those 1-D pieces, which torch
has no way to gather. So `install()` (torch_state_dict_shim.py) puts a shim in front of the four private
helpers the public functions call (looked up in the module's globals at call time, so scripts that
imported the public functions before shardpar are covered): a DistributedModel goes to the functions
below, any other model to torch's own code, unchanged.

`StateDictOptions`: `full_state_dict=False` (torch's default) gives the sharded form FSDP2 gives --
ShardedTensors aliasing this rank's pieces, which torch.distributed.checkpoint saves and loads in place
(dcp_state_dict.py; runtime/dcp_chunks.py says how DCP sees a piece) -- and `full_state_dict=True`
full tensors; `cpu_offload` moves the tensors to the CPU and, with `full_state_dict`, leaves them on
rank 0 only (as torch does); `ignore_frozen_params`, `strict` and `flatten_optimizer_state_dict`
behave as in torch; `broadcast_from_rank0` and `submodules` raise (the shim's `_refuse`). The `set_*`
functions take either form.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardpar.checkpoint import dcp_owned, dcp_persistent, dcp_state_dict
from shardpar.optim.chained import OptimizerList
from shardpar.optim.optimizer import DistributedOptimizer
from shardpar.runtime import write_guard
from shardpar.runtime.model import DistributedModel
from shardpar.runtime.shard_layout import ShardLayout
from shardpar.runtime.sharded_gather import full_value
from shardpar.runtime.sharded_tensor import ShardedTensor

STATE, GROUPS, PARAMS = "state", "param_groups", "params"  # torch.optim's state-dict keys


# ---- the model --------------------------------------------------------------------------------


def model_state_dict(model: DistributedModel, *, ignore_frozen_params: bool = False) -> dict[str, Any]:
    """One process's `model.state_dict()`: full tensors under the unwrapped model's keys (a collective)."""
    out: dict[str, Any] = model.state_dict()
    if ignore_frozen_params:  # torch drops the names named_parameters() gives (tied: the first)
        for name, p in model.named_parameters():
            if not p.requires_grad:
                out.pop(name, None)
    return out


# ---- the optimizer ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Stepped:
    """One tensor an optimizer steps: the parameter's FQN and how this rank's piece lies in it."""

    fqn: str
    layout: ShardLayout
    requires_grad: bool
    owned: bool = False  # stepped whole on an owner rank (dcp_owned.py)
    mine: bool = False  # ... and this rank is its owner

    @property
    def elsewhere(self) -> bool:
        """Owner-stepped on another rank: no state here."""
        return self.owned and not self.mine


def _inner(optimizer: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, DistributedOptimizer | None]:
    """(the torch optimizer that holds the state, the DistributedOptimizer around it or None), under
    accelerate's or transformers' wrappers (each keeps the one it wraps as `.optimizer`)."""
    seen = optimizer
    while not isinstance(seen, DistributedOptimizer):
        wrapped = getattr(seen, "optimizer", None)
        if not isinstance(wrapped, torch.optim.Optimizer):
            break
        seen = wrapped
    if isinstance(seen, DistributedOptimizer):
        return seen.optimizer, seen
    return seen, None  # a plain torch optimizer over model.parameters(): it steps the ShardedTensors


def _stepped(model: DistributedModel, dist: DistributedOptimizer | None) -> dict[int, _Stepped]:
    """id(tensor in the optimizer's param groups) -> what it is; names as `named_parameters()` gives
    them (a tied parameter under its first name, as torch's single-process state dict)."""
    state = model.sharded_state
    owned = dcp_owned.owned_ids(dist)
    out: dict[int, _Stepped] = {}
    for name, p in model.named_parameters():
        piece = state.piece_of(p)  # the user parameter, or the compute one after model.unshard()
        if piece is None:
            continue
        user = state.user_of(piece)
        if not isinstance(user, ShardedTensor):
            raise AssertionError(f"{name}: no sharded parameter behind it")
        stepped = dist.main_piece(p) if dist is not None else user
        if stepped is not None:
            mine = owned.get(id(stepped))
            layout, trained = user.shard_layout, piece.param.requires_grad
            out[id(stepped)] = _Stepped(name, layout, trained, owned=mine is not None, mine=bool(mine))
    return out


def _param_names(optimizer: torch.optim.Optimizer, stepped: Mapping[int, _Stepped]) -> list[list[_Stepped]]:
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        named = []
        for p in group[PARAMS]:
            where = stepped.get(id(p))
            if where is None:
                raise ValueError(
                    f"param group {i} of {type(optimizer).__name__} holds a tensor of shape {list(p.shape)} that is "
                    "not a parameter of this DistributedModel: pass the model the optimizer was built for "
                    "(smp.DistributedOptimizer over model.parameters())"
                )
            named.append(where)
        groups.append(named)
    return groups


def _full(value: Any, where: _Stepped, full: bool = True) -> Any:
    """A state value at the parameter's full shape: per-element tensors gathered, the rest copied; not
    `full`: per-element tensors as ShardedTensors aliasing this rank's piece, the rest as they are (what
    torch's sharded state dict holds, so that DCP loads into them in place). Owner-held state is whole
    already (dcp_owned.py)."""
    if where.owned:
        return dcp_owned.state_value(value, full=full)
    if not full:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            local = value.local_piece if isinstance(value, ShardedTensor) else value
            return dcp_state_dict.sharded(local, where.layout, cpu=False)
        return value
    if isinstance(value, ShardedTensor):
        return value.full_tensor()
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return full_value(value, where.layout)  # the 1-D piece (or a persistent parameter's whole value)
    if isinstance(value, torch.Tensor):
        return value.detach().clone()  # Adam's `step`
    return value


def optimizer_state_dict(
    model: DistributedModel, optimizer: torch.optim.Optimizer, *, full: bool = True
) -> dict[str, Any]:
    """One process's optimizer state dict with FQN keys, as torch's `get_optimizer_state_dict` returns
    it: {"state": {fqn: {name: full tensor or value}}, "param_groups": [{..., "params": [fqn, ...]}]}.
    A collective (the state tensors are gathered one by one). shardpar's loss scaler is not in it.
    Not `full`: the sharded form (dcp_state_dict.py), no collective. An empty state is filled first, as
    torch does (a step with lr 0 on zero gradients), so a fresh optimizer has tensors to load into."""
    inner, dist = _inner(optimizer)
    # the init step writes the state, and the sharded form hands out views dcp.load writes into
    write_guard.before_write("get_optimizer_state_dict()")
    dcp_owned.init_state(inner, dist)
    stepped = _stepped(model, dist)
    state: dict[str, Any] = {}
    param_groups: list[dict[str, Any]] = []
    for one in _torch_optimizers(inner):  # a list of optimizers: their groups one after the other
        flat = [where for group in _param_names(one, stepped) for where in group]
        packed = one.state_dict()  # param ids are positions in param-group order
        for i, s in packed[STATE].items():
            where = flat[i]
            state[where.fqn] = {k: _full(v, where, full) for k, v in s.items()}
        param_groups += [{**g, PARAMS: [flat[i].fqn for i in g[PARAMS]]} for g in packed[GROUPS]]
    owned = {w.fqn for w in stepped.values() if w.owned}
    if full and owned and dist is not None:  # the same on every rank: the owner plan is global
        dcp_owned.gather_full(dist, state, owned)
    return {STATE: state, GROUPS: param_groups}


def _torch_optimizers(inner: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    return list(inner.optimizers) if isinstance(inner, OptimizerList) else [inner]


def _piece(value: Any, where: _Stepped, like: torch.Tensor, live: Any = None) -> Any:
    """This rank's piece of a full-shape state tensor, as the optimizer keeps it (see `_full`). `live`:
    the optimizer's own tensor for this state now; a sharded value aliasing it (what `dcp.load` filled
    in place) is kept as it is, with no copy."""
    if not isinstance(value, torch.Tensor):
        return value
    if dcp_state_dict.is_alias(value, live):
        return live
    mine = dcp_state_dict.state_piece(value, where.layout, where.fqn)
    if mine is not None:  # a sharded state dict of this placement (after dcp.load): this rank's piece
        return ShardedTensor(mine, where.layout) if isinstance(like, ShardedTensor) else mine
    if isinstance(value, ShardedTensor):  # another placement: gathered (a collective, alike on every rank)
        value = value.full_tensor()
    if value.dim() == 0:  # a copy: Adam's `step` is counted up in place, the caller's must stay as it was
        return value.detach().clone()
    layout = where.layout
    if tuple(value.shape) != tuple(layout.shape):
        raise ValueError(
            f"optimizer state of {where.fqn}: a tensor of shape {list(value.shape)}, the parameter's is "
            f"{list(layout.shape)}; only per-element and scalar state loads into shardpar's sharded optimizer"
        )
    local = layout.piece_of(value.detach().to(like.device)).clone()
    return ShardedTensor(local, layout) if isinstance(like, ShardedTensor) else local


def load_optimizer_state_dict(
    model: DistributedModel, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any], *, strict: bool = True
) -> None:
    """Load what `optimizer_state_dict` returns (or its flattened form) into this rank's pieces. Every
    rank passes the same full state dict; each keeps its own piece. Checked before anything is loaded:
    the param groups by FQN, and (strict) state for every trainable parameter."""
    inner, dist = _inner(optimizer)
    groups = _param_names(inner, _stepped(model, dist))
    if STATE not in state_dict:
        state_dict = unflatten_optimizer_state_dict(state_dict, [[w.fqn for w in g] for g in groups], inner)
    saved_groups = list(state_dict[GROUPS])
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"optimizer state dict with {len(saved_groups)} param groups for an optimizer with {len(groups)}: "
            "build the optimizer with the same param groups as the one saved"
        )
    for i, (saved, mine) in enumerate(zip(saved_groups, groups, strict=True)):
        if list(saved[PARAMS]) != [w.fqn for w in mine]:
            diff = sorted(set(saved[PARAMS]) ^ {w.fqn for w in mine}) or ["(the same names, in another order)"]
            raise ValueError(f"optimizer param group {i} holds other parameters than the one saved, e.g. {diff[0]}")
    flat = [
        (p, where)
        for group, named in zip(inner.param_groups, groups, strict=True)
        for p, where in zip(group[PARAMS], named, strict=True)
    ]
    saved_state = state_dict[STATE]
    missing = [w.fqn for _, w in flat if w.requires_grad and not w.elsewhere and w.fqn not in saved_state]
    if strict and missing:
        raise ValueError(
            f"optimizer state dict has no state for {len(missing)} trainable parameters, e.g. {missing[0]!r}; "
            "pass StateDictOptions(strict=False) to load it anyway"
        )
    write_guard.before_write("set_optimizer_state_dict()")  # before complete(): it may write live state
    # persistent state: the rows other ranks read in dcp.load (a collective, after every check above)
    dcp_persistent.complete(saved_state.values(), model.sharded_state.device)
    first = 0
    for one in _torch_optimizers(inner):  # a list of optimizers: each its own groups, in order
        count = len(one.param_groups)
        held = flat[first : first + sum(len(g[PARAMS]) for g in one.param_groups)]
        first += len(held)
        state = {
            i: {k: _load_value(v, where, p, one.state.get(p, {}).get(k)) for k, v in saved_state[where.fqn].items()}
            for i, (p, where) in enumerate(held)
            if where.fqn in saved_state and not where.elsewhere  # another rank's owner keeps that state
        }
        positions, params = iter(range(len(held))), []
        for group in saved_groups[:count]:
            params.append({**group, PARAMS: [next(positions) for _ in group[PARAMS]]})
        saved_groups = saved_groups[count:]
        one.load_state_dict({STATE: state, GROUPS: params})


def _load_value(value: Any, where: _Stepped, p: torch.Tensor, live: Any) -> Any:
    if where.owned:
        return dcp_owned.load_value(value, live, p, where.fqn)
    return _piece(value, where, p, live)


def unflatten_optimizer_state_dict(
    flat: Mapping[str, Any], group_fqns: list[list[str]], optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """torch's `flatten_optimizer_state_dict=True` form ("state.<fqn>.<name>", "param_groups.<fqn>.<option>")
    back to the nested one, for these param groups."""
    state: dict[str, Any] = {}
    for fqns in group_fqns:
        for fqn in fqns:
            prefix = f"{STATE}.{fqn}."
            for key, value in flat.items():
                if key.startswith(prefix):
                    *path, last = key[len(prefix) :].split(".")
                    node = state.setdefault(fqn, {})
                    for part in path:  # nested state (Shampoo-like optimizers)
                        node = node.setdefault(part, {})
                    node[last] = value
    groups = []
    for fqns, group in zip(group_fqns, optimizer.param_groups, strict=True):
        options = {
            k: flat[f"{GROUPS}.{fqns[0]}.{k}"] for k in group if k != PARAMS and f"{GROUPS}.{fqns[0]}.{k}" in flat
        }
        groups.append({**options, PARAMS: list(fqns)})
    return {STATE: state, GROUPS: groups}
