"""OptimizerState: everything the optimizer reads and writes of a DistributedModel, in one place.

The optimizer meets the sharded state through this interface only -- the pieces it steps, their
main values and gradients, who owns each whole parameter (owner compute), which parameters had no
gradient in the window, the accumulation window and its loss scale, and the step's end -- instead of
reaching into the model's runtime fields one by one. Behaviour is the runtime's; this file only names
what the optimizer may touch, so a change in the runtime shows up here and nowhere else in optim/.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shardpar.collectives import Engine, Group
from shardpar.runtime.model import DistributedModel
from shardpar.runtime.state import Piece, ShardedState
from shardpar.runtime.window import AccumulationWindow, ScaleSource
from shardpar.sharding.tp_split import TPSplit
from shardpar.topology import Topology


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
    def pieces(self) -> list[Piece]:
        return self.sharded.pieces

    def main(self, piece: Piece) -> torch.Tensor:
        return self.sharded.main(piece)

    def grad(self, piece: Piece) -> torch.Tensor | None:
        return self.sharded.grad(piece)

    def main_grads(self) -> list[torch.Tensor]:
        return self.sharded.main_grads()

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

    def without_grad(self, dropped: set[int]) -> set[int]:
        """Ids of the parameters not stepped this time: no gradient in the window ([Note: unused params]
        in model.py) or a user grad dropped (`dropped`, from user_params.sync)."""
        return self._model.unused_params | dropped

    def refresh_compute(self) -> None:
        """After the step wrote main values: the compute copies (a collective with shard_optimizer_state)."""
        self.sharded.refresh_compute()
