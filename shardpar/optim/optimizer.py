"""DistributedOptimizer: any torch.optim optimizer, re-pointed at this rank's fp32 main shards.

Each original parameter of a param group is replaced by its *main piece*: a leaf tensor aliasing
this rank's slice of the unit's fp32 main shard (possibly empty), whose `.grad` aliases the same
slice of the unit's main grad. Element-wise optimizers (SGD, Adam, AdamW, ...) therefore update
exactly the elements a single-process run would, and param groups, hyperparameters and LR schedulers
keep working on the same optimizer object. Persistent parameters are stepped as they are.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardpar.optim.grad_norm import grad_norm_squared
from shardpar.optim.loss_scaling import LossScaler, ScalerResume, StaticLossScaler, plan_scaler_resume
from shardpar.precision import precision_name
from shardpar.runtime.model import DistributedModel
from shardpar.runtime.state import Piece
from shardpar.sharding.tp_split import TPSplit


class DistributedOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer (so LR schedulers accept it) that delegates to the wrapped optimizer.

    `Optimizer.__init__` is deliberately not called: param groups, state and defaults are the inner
    optimizer's, exposed as properties.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: DistributedModel,
        *,
        clip_norm: float,
        loss_scaler: LossScaler | None = None,
        tp_splits: Mapping[str, TPSplit] | None = None,
    ) -> None:
        """`tp_splits`: the model's TP-split parameters by name (tensor_parallel.tp_split_table), passed
        in by the caller under tensor parallelism; None or empty without it."""
        self.optimizer = optimizer
        self.model = model
        self.sharded_state = model.sharded_state
        self.clip_norm = clip_norm
        self.tp_splits = tp_splits
        self.loss_scaler: LossScaler = loss_scaler or StaticLossScaler(1.0)
        self.overflow = False
        model.window.set_loss_scale(self.loss_scaler.loss_scale)
        self._main_piece: dict[int, nn.Parameter] = {}
        self._grad_slots: list[tuple[nn.Parameter, Piece]] = []  # (main piece, where it lies) of trainable params
        self._build_pieces()
        self._repoint_groups()
        self.last_grad_norm: torch.Tensor | None = None

    def _build_pieces(self) -> None:
        state = self.sharded_state
        for where in state.pieces:
            p = where.param
            piece = nn.Parameter(state.main(where), requires_grad=p.requires_grad)
            self._main_piece[id(p)] = piece
            if p.requires_grad:
                self._grad_slots.append((piece, where))

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
        unused = self.model.unused_params
        for piece, where in self._grad_slots:
            piece.grad = None if id(where.param) in unused else self.sharded_state.grad(where)

    def grad_norm_squared(self) -> torch.Tensor:
        """Squared global L2 norm of the (still scaled) grads: every element counted once.

        One AllReduce over the sharding group: shards are disjoint inside it; persistent grads are the
        same on every rank after their rdp AllReduce, so only sharding-group position 0 adds them.
        Replicas hold identical main grads after the boundary AllReduce, so they agree without
        talking. An inf/nan anywhere makes the sum non-finite on every rank: the overflow check.
        A tensor-parallel model sums its TP-split grads over the TP group too and counts TP-replicated
        ones once (shardpar/optim/grad_norm.py).
        """
        return grad_norm_squared(self.sharded_state, self.tp_splits)

    def _unscale_and_clip(self, sq: torch.Tensor, scale: float) -> torch.Tensor:
        """Divide out the loss scale the gradients carry and apply sdp_gradient_clipping, as one
        multiply per grad.

        The clip coefficient is torch.nn.utils.clip_grad_norm_'s formula (parity with a single-process
        run); it stays a tensor, so there is no host sync here.
        """
        inv_scale = 1.0 / scale
        norm = sq.sqrt() * inv_scale
        coef = torch.full_like(norm, inv_scale)
        if self.clip_norm > 0:
            coef = coef * torch.clamp(self.clip_norm / (norm + 1e-6), max=1.0)
        if self.clip_norm > 0 or inv_scale != 1.0:
            for grad in self.sharded_state.main_grads():
                grad.mul_(coef)
        return norm[0]

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise ValueError("DistributedOptimizer.step does not take a closure (the model is sharded)")
        self.model.window.check_step()  # before anything changes
        fp16 = self.model.policy.compute == torch.float16
        needs_norm = fp16 or self.clip_norm > 0 or self.loss_scaler.dynamic or self.loss_scaler.loss_scale != 1.0
        sq = self.grad_norm_squared() if needs_norm else None
        scale = self.model.window.loss_scale  # what this window's backwards multiplied the loss by
        if sq is not None and fp16:
            # fp16, whatever the scale and clipping: an inf/nan on any rank makes the norm's one
            # AllReduce non-finite everywhere. The only host sync of the step, needed to decide the
            # skip on every rank alike.
            self.overflow = not bool(torch.isfinite(sq).item())
            self.loss_scaler.update(self.overflow)
            if self.overflow:
                self.model.window.set_loss_scale(self.loss_scaler.loss_scale)
                self.model.end_step()
                return None
        # `scale`, not the scaler's: a dynamic scaler that just grew its scale (update above) must not
        # divide these gradients, scaled by the old one, by the new one.
        self.last_grad_norm = self._unscale_and_clip(sq, scale) if sq is not None else None
        self._attach_grads()
        result = self.optimizer.step()
        self.sharded_state.refresh_compute()
        self.model.window.set_loss_scale(self.loss_scaler.loss_scale)
        self.model.end_step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.window.reset()  # the window's gradients are dropped
        if set_to_none:  # like torch: grads that stay (zeroed) tensors keep being stepped
            self.model.reset_grad_usage()
        self.sharded_state.clear_grads(set_to_none=set_to_none)
        for piece, _ in self._grad_slots:
            piece.grad = None

    def main_piece(self, p: torch.Tensor) -> nn.Parameter | None:
        """The leaf the inner optimizer steps for original parameter `p` (its local main shard)."""
        return self._main_piece.get(id(p))

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
        """This rank's optimizer state (for its shards) in torch.optim's format, plus the loss scaler."""
        return {**self.optimizer.state_dict(), "loss_scaler": self.loss_scaler_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load `state_dict()`; the loss scaler follows [Note: loss scaler on resume] (loss_scaling.py),
        decided (and a malformed scaler state rejected) before anything is loaded."""
        state = dict(state_dict)
        scaler = state.pop("loss_scaler", None)
        plan = self.plan_loss_scaler_load(scaler) if scaler is not None else None
        self.optimizer.load_state_dict(state)
        if plan is not None:
            self.load_loss_scaler_state(scaler, plan)

    # ---- loss scaler in checkpoints -----------------------------------------------------------

    def loss_scaler_state(self) -> dict[str, Any]:
        """The scaler's state and the precision it served, so a resume can tell whether it applies."""
        return {**self.loss_scaler.state_dict(), "precision": precision_name(self.model.policy.compute)}

    def plan_loss_scaler_load(self, saved: dict[str, Any]) -> ScalerResume:
        """Whether `saved` applies to this run; ValueError naming the field when it is malformed."""
        return plan_scaler_resume(saved, self.loss_scaler, self.model.policy.compute)

    def load_loss_scaler_state(self, saved: dict[str, Any], plan: ScalerResume) -> None:
        if plan.warning is not None:
            warnings.warn(plan.warning, stacklevel=3)
        if plan.apply:
            self.loss_scaler.load_state_dict(saved)
        self.model.window.set_loss_scale(self.loss_scaler.loss_scale)  # what model.backward multiplies by

    def add_param_group(self, group: dict[str, Any]) -> None:
        raise ValueError("add_param_group after wrapping is not supported; build all groups before wrapping")

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"
