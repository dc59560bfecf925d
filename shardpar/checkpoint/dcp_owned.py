"""Owner-held optimizer state ([Note: owner compute], optim/owner_compute.py) in the optimizer state
dicts of torch.distributed.checkpoint.state_dict (torch_state_dict.py).

An owner-stepped parameter's state is whole (TP-merged) on its owner and absent elsewhere, which is
already the shape a state dict wants -- one tensor per key -- only not on every rank:

    sharded form (full_state_dict=False, for dcp.save / dcp.load): each owner lists its live whole state
        tensors as plain tensors, other ranks leave the parameter's key out. DCP takes a plain tensor as
        one chunk covering the whole tensor; owners of the same parameter in other replicas or TP ranks
        hold the same values and DCP's save writes the chunk once. On load, whichever rank owns the
        parameter now -- at any world size, sdp or shard_optimizer_state -- lists it in its template and
        DCP reads the whole tensor into it; the others read nothing.
    full form (full_state_dict=True): the owners' entries are gathered to every rank (one all_gather of
        objects), as torch's full state dict has every key on every rank.

Loading either form, a rank keeps the whole state of the parameters it owns and ignores the rest.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dsd

from shardpar.checkpoint.owned_state import writes_owned
from shardpar.optim.optimizer import DistributedOptimizer
from shardpar.runtime.sharded_tensor import ShardedTensor


def owned_ids(optimizer: DistributedOptimizer | None) -> dict[int, bool]:
    """id(leaf the inner optimizer steps) -> whether this rank owns it, for every owner-stepped parameter."""
    if optimizer is None:
        return {}
    return {id(leaf): mine for _, leaf, mine in optimizer.owned_leaves()}


def init_state(inner: torch.optim.Optimizer, optimizer: DistributedOptimizer | None) -> None:
    """torch's `_init_optim_state` (a step with lr 0 on zero gradients, so that `dcp.load` has tensors to
    load into); mirrored where state is owner-held, so that a leaf this rank does not own gets no gradient:
    torch optimizers skip it, and its state stays on the owner only, as in training."""
    owned = owned_ids(optimizer)
    if not owned:
        dsd._init_optim_state(inner)  # torch's own, where nothing is owner-held
        return
    if inner.state or any(p.grad is not None for g in inner.param_groups for p in g["params"]):
        return
    for group in inner.param_groups:
        for p in group["params"]:
            if p.requires_grad and owned.get(id(p), True):
                p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in inner.param_groups if "lr" in g]
    for g in inner.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    inner.step()
    for g in inner.param_groups:
        if "lr" in g:
            g["lr"] = lrs.pop(0)
    inner.zero_grad(set_to_none=True)
    if optimizer is not None:
        for oc in optimizer.owners:
            # an optimizer that ignores lr (transformers' Adafactor with relative_step) moved the owners'
            # whole copies: read the values from the shards again at the next step
            oc.forget_values()


def state_value(value: Any, *, full: bool) -> Any:
    """An owned state value as the state dict holds it: the live tensor in the sharded form (DCP loads
    into it in place), a copy in the full form."""
    if full and isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def gather_full(optimizer: DistributedOptimizer, state: dict[str, Any], owned_fqns: set[str]) -> None:
    """The full form: every owned parameter's entry on every rank, from one owner each (TP rank 0, replica
    0: owned_state.writes_owned). A collective over the world."""
    coords = optimizer.sharded_state.topology.coords
    mine = {}
    if writes_owned(coords, optimizer.sharded_state.replica_sharded):
        mine = {f: _to_cpu(state[f]) for f in owned_fqns if f in state}
    for f in owned_fqns:
        state.pop(f, None)  # another replica's or TP rank's owner sends it
    gathered: list[Any] = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather_object(gathered, mine)
    device = optimizer.owned_leaves()[0][1].device if optimizer.owned_leaves() else torch.device("cpu")
    for entries in gathered:
        for fqn, entry in entries.items():
            state[fqn] = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in entry.items()}


def _to_cpu(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().to("cpu") if isinstance(v, torch.Tensor) else v for k, v in entry.items()}


def load_value(value: Any, live: Any, leaf: torch.Tensor, fqn: str) -> Any:
    """What the owner's optimizer keeps for a saved owned state value: the live tensor when `dcp.load`
    filled it in place, else a copy on the leaf's device."""
    if not isinstance(value, torch.Tensor):
        return value
    if value is live:
        return live
    if isinstance(value, ShardedTensor):
        raise ValueError(
            f"set_optimizer_state_dict: the state of {fqn!r} is a sharded tensor, but this optimizer steps "
            f"{fqn!r} whole on one owner rank and keeps its state whole there. Load into the template "
            "get_optimizer_state_dict returns (dcp.load fills it), or pass a full state dict "
            "(StateDictOptions(full_state_dict=True))"
        )
    return value.detach().to(leaf.device).clone()
