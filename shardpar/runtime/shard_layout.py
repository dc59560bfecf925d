"""Which part of one parameter a rank holds, and the groups it is split over: what a ShardedTensor
(sharded_tensor.py) carries besides its local piece ([Note: sharded parameters])."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardpar.collectives import Engine, Group
from shardpar.sharding.tp_split import TPSplit


@dataclass(frozen=True)
class ShardComm:
    """What a whole-tensor reduction needs: the engine and the groups a parameter is split over --
    `sharding`, the group whose pieces of a parameter are disjoint (the sharding group; the rdp group
    with shard_optimizer_state, whose owned pieces split each shard over the replicas too), and `tp`."""

    engine: Engine
    sharding: Group
    tp: Group


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """Which part of one parameter this rank holds ([Note: sharded parameters]).

    The module's parameter (`local_shape`; TP-local under tensor parallelism) is flattened and this rank
    holds elements [start, start + length) of it; a TP-split parameter is itself TP rank `tp_rank`'s
    piece of the full tensor (`shape`)."""

    fqn: str
    shape: torch.Size  # what torch sees: the full parameter
    local_shape: tuple[int, ...]  # the module's parameter (TP-local)
    start: int
    length: int
    sharded: bool  # False: persistent, whole on every rank of the sharding group
    comm: ShardComm
    tp: TPSplit | None = None
    tp_rank: int = 0
    # Called when an op writes a tensor of this layout in place: the user parameters' layouts tell the
    # sharded state that its main values changed (a plain optimizer step), so the compute copies refresh.
    on_write: Callable[[], None] | None = None
    # Called before such an op runs: the user parameters' layouts wait there for an async checkpoint
    # still copying the main shards ([Note: writes wait for staging] in write_guard.py).
    before_write: Callable[[], None] | None = None
    # Called when a whole-tensor norm of a tensor of this layout is taken: the gradients' layouts tell
    # the model that a norm was read, which with a write after it is a user's own clip (user_params.py).
    on_norm: Callable[[], None] | None = None
    # Called before an op reads or writes a tensor of this layout: a quantized frozen base's user
    # parameters give their shard its (dequantized) values back first ([Note: quantized base keeps no
    # exact shard], frozen_exact.py); its storage is empty until then.
    on_use: Callable[[], None] | None = None

    @property
    def split(self) -> bool:
        """Whether other ranks hold other elements of this tensor (a reduction over them needs a collective)."""
        return (self.sharded and self.comm.sharding.size > 1) or (self.tp is not None and self.comm.tp.size > 1)

    @property
    def whole(self) -> bool:
        """This rank holds every element: ops run on it as on a plain tensor."""
        return not self.sharded and self.tp is None

    def piece_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a plain tensor of the full shape (a view where it can be)."""
        local = full if self.tp is None else self.tp.local_of(full, self.tp_rank)
        return local.reshape(-1)[self.start : self.start + self.length] if self.sharded else local

    def describe(self) -> str:
        if not self.sharded:
            return f"{self.fqn} (TP rank {self.tp_rank}'s slice {list(self.local_shape)} of {list(self.shape)})"
        numel = math.prod(self.local_shape)
        if not self.length:
            return f"{self.fqn} (none of its {numel} elements on this rank)"
        return f"{self.fqn} (elements {self.start}..{self.start + self.length} of {numel} on this rank)"


def refusal(func: Any, layout: ShardLayout) -> str:
    return (
        f"{func} on {layout.describe()}: outside forward a shardpar parameter holds only this rank's piece of "
        f"its full shape {list(layout.shape)}, so only element-wise maths, copies and whole-tensor reductions "
        "(norms, sum, max) work on it. For training use smp.DistributedOptimizer (shape-aware optimizers such "
        "as Adafactor are refused there with what to use instead); for the full values use model.state_dict() "
        "(every rank calls it); or compute inside the model's forward, where the parameters are gathered"
    )
