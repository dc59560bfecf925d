"""Optimizer state held whole by an owner rank ([Note: owner compute], optim/owner_compute.py) in
partial checkpoints.

Save: the owner writes each state tensor whole, as `owned/<name>/<fqn>` in its own rank file, once per
checkpoint -- TP rank 0's owner (TP-split parameters are stepped TP-merged, so every TP rank's owner
holds the same state) of replica 0 (replicas' owners hold the same state; with shard_optimizer_state
there is one owner per TP slice). The index's optimizer state entry of the parameter is
`{"owned": {"file", "tensors": {name: [dtype, shape]}, "scalars": {...}}}`.

Load: the state is whole and TP-merged, so it fits any world size, sdp, tensor_parallel_degree and
ownership: whichever rank owns the parameter now reads it from that file; the others read nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from shardpar.checkpoint import index as ix
from shardpar.checkpoint.safetensors_io import CheckpointError, dtype_name, dtype_of
from shardpar.optim.optimizer import DistributedOptimizer
from shardpar.topology import RankCoords

PREFIX = "owned"


def owned_key(name: str, fqn: str) -> str:
    return f"{PREFIX}/{name}/{fqn}"


def writes_owned(coords: RankCoords, replica_sharded: bool) -> bool:
    return coords.tp_rank == 0 and (coords.replica == 0 or replica_sharded)


def owned_entries(optimizer: DistributedOptimizer, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The whole state of the parameters this rank owns: tensors added to `tensors` as `owned/<name>/<fqn>`,
    and per FQN {"tensors": {name: [dtype, shape]}, "scalars": {...}} (partial checkpoints and snapshots)."""
    out: dict[str, Any] = {}
    state = optimizer.optimizer.state
    for fqn, leaf, mine in optimizer.owned_leaves():
        entry = state.get(leaf) if mine else None
        if not entry:
            continue
        whole, scalars = {}, {}
        for k, v in entry.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                whole[k] = [dtype_name(v.dtype), list(v.shape)]
                tensors[owned_key(k, fqn)] = v.contiguous()
            else:
                scalars[k] = ix.encode(v, where=f"optimizer state {k!r} of {fqn!r}")
        out[fqn] = {"tensors": whole, "scalars": scalars}
    return out


def collect_owned(
    optimizer: DistributedOptimizer, coords: RankCoords, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> None:
    """Add this rank's owned state (whole tensors) to its file and index entries."""
    if not writes_owned(coords, optimizer.sharded_state.replica_sharded):
        return
    for fqn, entry in owned_entries(optimizer, tensors).items():
        meta[fqn] = {PREFIX: {"file": ix.shard_file(coords.rank), **entry}}


def owned_files(index: dict[str, Any], optimizer: DistributedOptimizer) -> set[str]:
    """The files this rank reads owned state from."""
    saved = (index.get("optimizer") or {}).get("state", {})
    return {saved[f][PREFIX]["file"] for f, _, mine in optimizer.owned_leaves() if mine and PREFIX in saved.get(f, {})}


def load_owned(read: Any, index: dict[str, Any], optimizer: DistributedOptimizer, state: Any, where: str) -> set[str]:
    """Put the saved whole state of the parameters this rank owns into `state`; returns the FQNs that
    are owner-stepped here (the caller leaves them out of its per-piece loading). `read(file, key)`."""
    saved = index["optimizer"]["state"]
    handled = set()
    for fqn, leaf, mine in optimizer.owned_leaves():
        handled.add(fqn)
        meta = saved.get(fqn)
        if meta is None:
            continue
        if PREFIX not in meta:
            raise CheckpointError(
                f"{where}: {fqn!r} was saved stepped piecewise and is stepped whole now; resume with the "
                "optimizer it was saved with"
            )
        if not mine:
            continue
        file = meta[PREFIX]["file"]
        state[leaf] = owned_entry(meta[PREFIX], lambda key, file=file: read(file, key), fqn, leaf.device, where)
    return handled


def owned_entry(saved: dict[str, Any], read: Any, fqn: str, device: torch.device, where: str) -> dict[str, Any]:
    """One parameter's optimizer state from what `owned_entries` recorded; `read(key)` gives a tensor."""
    entry: dict[str, Any] = {k: ix.decode(v, device=device) for k, v in saved["scalars"].items()}
    for k, (dtype, shape) in saved["tensors"].items():
        t = read(owned_key(k, fqn))
        if t.dtype != dtype_of(dtype) or list(t.shape) != list(shape):
            raise CheckpointError(f"{where}: {owned_key(k, fqn)} is {t.dtype} {list(t.shape)}, not {shape}")
        entry[k] = t.to(device)
    return entry
