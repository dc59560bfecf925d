"""OptimizerState: everything the optimizer reads and writes of a DistributedModel, in one place.

[Note: the optimizer's one interface]
The optimizer meets the sharded state through this interface only -- the pieces it steps, their
main values and gradients, who owns each whole parameter (owner compute), which parameters had no
gradient in the window, the accumulation window and its loss scale, and the step's end -- instead of
reaching into the model's runtime fields one by one. Behaviour is the runtime's; this file only names
what the optimizer may touch, so a change in the runtime shows up here and nowhere else in optim/.
It is the one module of optim/ that imports shardpar.runtime (it re-exports the types the others
name: Piece, ShardedState, FlatPartitions); tests/unit/test_optim_interface.py scans the others for a
runtime import, a `model.` / `sharded_state.` field or another object's private attribute.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from shardpar.collectives import Engine, Group
from shardpar.runtime import deepspeed_views
from shardpar.runtime.deepspeed_views import FlatPartitions
from shardpar.runtime.model import DistributedModel
from shardpar.runtime.state import GradBlock, Piece, ShardedState
from shardpar.runtime.window import AccumulationWindow, ScaleSource
from shardpar.sharding.tp_split import TPSplit
from shardpar.topology import Topology

__all__ = ["FlatPartitions", "OptimizerState", "Piece", "ShardedState"]


class OptimizerState:
    def __init__(self, model: DistributedModel, tp_splits: Mapping[str, TPSplit] | None) -> None:
        self._model = model
        self.sharded: ShardedState = model.sharded_state
        self.tp_splits: Mapping[str, TPSplit] = tp_splits or {}

    # ---- where things are ----------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        return self.sharded.engine

    @property
    def topology(self) -> Topology:
        return self.sharded.topology

    @property
    def device(self) -> torch.device:
        return self.sharded.device

    @property
    def compute_dtype(self) -> torch.dtype:
        return self._model.policy.compute

    @property
    def pieces(self) -> list[Piece]:
        return self.sharded.pieces

    @property
    def users(self) -> list[torch.Tensor]:
        """The user parameters (ShardedTensors), one per piece in `pieces` order."""
        return list(self._model.user_params.user)

    def param_names(self) -> dict[int, str]:
        """id(parameter) -> its name in the wrapped module (every name of a tied one: the last)."""
        return {id(p): n for n, p in self._model.module.named_parameters(remove_duplicate=False)}

    def piece_of(self, param: object) -> Piece | None:
        return self.sharded.piece_of(param)

    def main(self, piece: Piece) -> torch.Tensor:
        return self.sharded.main(piece)

    def grad(self, piece: Piece) -> torch.Tensor | None:
        return self.sharded.grad(piece)

    def main_grads(self) -> list[torch.Tensor]:
        return self.sharded.main_grads()

    def grad_blocks(self) -> list[GradBlock]:
        return self.sharded.grad_blocks()

    @property
    def replica_sharded(self) -> bool:
        """shard_optimizer_state splits the shards over the replicas ([Note: replica-sharded main])."""
        return self.sharded.replica_sharded

    # ---- knobs ---------------------------------------------------------------------------------

    @property
    def max_nonfinite_steps(self) -> int:
        return self._model.shardpar_config.sdp_max_nonfinite_steps

    @property
    def shard_optimizer_state(self) -> bool:
        return self._model.shardpar_config.shard_optimizer_state

    # ---- owners ------------------------------------------------------------------------------

    def exchange_group(self) -> Group:
        """The ranks one whole parameter is spread over; an owner is one of them."""
        return self.sharded.exchange_group()

    def member_ranges(self, piece: Piece) -> list[tuple[int, int]]:
        return self.sharded.member_ranges(piece)

    @property
    def values_version(self) -> int:
        """Changes whenever main values may have been written outside an owner step."""
        return self.sharded.values_version

    # ---- the window ------------------------------------------------------------------------------

    @property
    def window(self) -> AccumulationWindow:
        return self._model.window

    def check_step(self) -> None:
        """Refuse a step inside an accumulation window, before anything changes (window.py)."""
        self._model.window.check_step()

    def use_scaler(self, scaler: ScaleSource) -> None:
        """The loss scale `model.backward` multiplies by is `scaler`'s from now on ([Note: one owner of
        the loss scale], runtime/window.py)."""
        self._model.window.use_scaler(scaler)

    def check_save(self, what: str, lost: str) -> None:
        self._model.window.check_save(what, lost)

    @property
    def nonfinite_losses(self) -> torch.Tensor:
        """How many losses model.backward saw non-finite in the open window (a 0-d tensor: no sync)."""
        return self._model.nonfinite_losses

    # ---- user gradients ([Note: user gradients], runtime/user_params.py) -------------------------

    def sync_user_grads(self) -> set[int]:
        """What the user did to the parameters' .grad since backward; the ids of those now without one."""
        return self._model.user_params.sync()

    @property
    def user_clipped(self) -> bool:
        """A clip of the model's parameters' .grad ran in the open window ([Note: a user's own clip])."""
        return self._model.user_params.clip_watch.clipped

    # ---- the step's end, zero_grad -----------------------------------------------------------------

    def end_step(self) -> None:
        self._model.end_step()

    def zero_grad(self, set_to_none: bool) -> None:
        self._model.zero_grad(set_to_none)

    def without_grad(self, dropped: set[int]) -> set[int]:
        """Ids of the parameters not stepped this time: no gradient in the window ([Note: unused params]
        in model.py) or a user grad dropped (`dropped`, from user_params.sync)."""
        return self._model.unused_params | dropped

    def will_write(self, what: str) -> None:
        """Before `what` writes main values or optimizer state: wait for an async checkpoint still copying
        them ([Note: writes wait for staging] in runtime/write_guard.py)."""
        self.sharded.will_write(what)

    def refresh_compute(self) -> None:
        """After the step wrote main values: the compute copies (a collective with shard_optimizer_state)."""
        self.sharded.refresh_compute()

    # ---- SMP v1's DeepSpeed views (runtime/deepspeed_views.py) -------------------------------------

    def shard_process_group(self) -> Any:
        """The torch.distributed group the parameters' partitions split over (ds_param_shard_group)."""
        users = self._model.user_params.user
        if not users:
            raise ValueError("ds_param_shard_group: the model has no parameters")
        return deepspeed_views.process_group(users[0].shard_layout.comm.sharding)

    def fp32_partitions(self, users: list[torch.Tensor]) -> FlatPartitions:
        """The fp32 main partitions of `users` (user parameters) end to end, as live views."""
        parts = []
        for u in users:
            piece = self.sharded.piece_of(u)
            if piece is None:
                raise AssertionError("a parameter of the optimizer has no piece in the model's sharded state")
            parts.append(deepspeed_views.partition(self.sharded.main(piece), u.shard_layout))  # type: ignore[attr-defined]
        return FlatPartitions(parts, [u.shard_layout.fqn for u in users])  # type: ignore[attr-defined]
