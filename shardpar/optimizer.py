"""DistributedOptimizer: any torch.optim optimizer, re-pointed at this rank's fp32 main shards.

Each original parameter of a param group is replaced by its *main piece*: a leaf tensor aliasing
this rank's slice of the unit's fp32 main shard (possibly empty), whose `.grad` aliases the same
slice of the unit's main grad. Element-wise optimizers (SGD, Adam, AdamW, ...) therefore update
exactly the elements a single-process run would, and param groups, hyperparameters and LR schedulers
keep working on the same optimizer object. Persistent parameters are stepped as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardpar.collectives import ReduceOp
from shardpar.model import DistributedModel


class DistributedOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer (so LR schedulers accept it) that delegates to the wrapped optimizer.

    `Optimizer.__init__` is deliberately not called: param groups, state and defaults are the inner
    optimizer's, exposed as properties.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: DistributedModel, *, clip_norm: float) -> None:
        self.optimizer = optimizer
        self.model = model
        self.clip_norm = clip_norm
        self._main_piece: dict[int, nn.Parameter] = {}
        self._grad_slots: list[tuple[nn.Parameter, Any, slice]] = []  # (piece, unit, local slice)
        self._build_pieces()
        self._repoint_groups()
        self.last_grad_norm: torch.Tensor | None = None

    def _build_pieces(self) -> None:
        for unit in self.model.units:
            for p, sl in zip(unit.params, unit.slices, strict=True):
                piece = nn.Parameter(unit.main_shard[sl.local], requires_grad=p.requires_grad)
                self._main_piece[id(p)] = piece
                if p.requires_grad:
                    self._grad_slots.append((piece, unit, sl.local))
        for _, p in self.model.persistent:
            self._main_piece[id(p)] = p

    def _repoint_groups(self) -> None:
        if self.optimizer.state:
            raise ValueError(
                "the optimizer already has state; wrap it with smp.DistributedOptimizer before its first step"
            )
        names = {id(p): n for n, p in self.model.module.named_parameters(remove_duplicate=False)}
        for group in self.optimizer.param_groups:
            new_params = []
            for p in group["params"]:
                if id(p) not in self._main_piece:
                    raise ValueError(
                        f"optimizer parameter {names.get(id(p), tuple(p.shape))} does not belong to the "
                        "DistributedModel; build the optimizer from model.parameters() after wrapping"
                    )
                new_params.append(self._main_piece[id(p)])
            group["params"] = new_params

    # ---- step ---------------------------------------------------------------------------------

    def _attach_grads(self) -> None:
        for piece, unit, local in self._grad_slots:
            piece.grad = None if unit.main_grad is None else unit.main_grad[local]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm over all shards and persistent params (each element once); scale if above.

        One AllReduce over the sharding group: shards are disjoint inside it, persistent grads are the
        same on every rank after their rdp AllReduce, so only sharding-group position 0 adds them.
        No host sync: the scale is applied as a tensor.
        """
        device = self.model.device
        sq = torch.zeros(1, dtype=torch.float32, device=device)
        for unit in self.model.units:
            if unit.main_grad is not None:
                sq += unit.main_grad.pow(2).sum()
        if self.model.topology.coords.sdp_rank == 0:
            for _, p in self.model.persistent:
                if p.grad is not None:
                    sq += p.grad.detach().float().pow(2).sum()
        self.model.engine.all_reduce(sq, self.model.topology.sharding, op=ReduceOp.SUM)
        norm = sq.sqrt()
        if max_norm > 0:
            # torch.nn.utils.clip_grad_norm_'s formula, so parity with a single-process run holds.
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for unit in self.model.units:
                if unit.main_grad is not None:
                    unit.main_grad.mul_(coef)
            for _, p in self.model.persistent:
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad.dtype))
        return norm[0]

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise ValueError("DistributedOptimizer.step does not take a closure (the model is sharded)")
        self.last_grad_norm = self.clip_grad_norm(self.clip_norm) if self.clip_norm > 0 else None
        self._attach_grads()
        return self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for unit in self.model.units:
            if set_to_none:
                unit.main_grad = None
            elif unit.main_grad is not None:
                unit.main_grad.zero_()
        for piece, _, _ in self._grad_slots:
            piece.grad = None
        for _, p in self.model.persistent:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # ---- torch.optim surface ------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (for its shards), in torch.optim's format."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, group: dict[str, Any]) -> None:
        raise ValueError("add_param_group after wrapping is not supported; build all groups before wrapping")

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"
