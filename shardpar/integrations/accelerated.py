"""The shardpar objects as accelerate sees them: `ShardparOptimizer`, accelerate's optimizer wrapper
around a DistributedOptimizer, and which modules, optimizers and tensors belong to a DistributedModel
(what `Accelerator.prepare` and `clip_grad_norm_` hand to shardpar)."""

from __future__ import annotations

from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn

import shardpar as smp
from shardpar.config import Config
from shardpar.optim.clipping import ACCELERATE, KNOB
from shardpar.optim.optimizer import DistributedOptimizer
from shardpar.runtime.model import DistributedModel

# fp16: torch.amp.GradScaler's defaults (what transformers' and accelerate's fp16 use), for shardpar's
# dynamic loss scaler (its own default starts at 2**32, as SMP v1 and DeepSpeed do).
GRAD_SCALER_ARGS: dict[str, Any] = {"init_scale": 2.0**16, "scale_factor": 2.0, "scale_window": 2000}
DEFAULT_CLIPPING = Config().sdp_gradient_clipping


def distributed_optimizer(optimizer: torch.optim.Optimizer, model: DistributedModel) -> DistributedOptimizer:
    """`smp.DistributedOptimizer` over `model`'s shards, scaling fp16 losses as Hugging Face's fp16 does."""
    if model.policy.compute == torch.float16:
        return smp.DistributedOptimizer(
            optimizer, dynamic_loss_scale=True, dynamic_loss_args=GRAD_SCALER_ARGS, model=model
        )
    return smp.DistributedOptimizer(optimizer, model=model)


def take_clipping(optimizer: DistributedOptimizer) -> None:
    """Under accelerate the clipping is accelerate's: only where the loop calls `clip_grad_norm_`, none inside
    `optimizer.step()` ([Note: clipping belongs to the user's front end], optim/clipping.py). The Trainer's
    (max_grad_norm) stays; a sdp_gradient_clipping other than its default or 0 asked for something else."""
    clipping = optimizer.clipping
    if clipping.owner != KNOB:
        return
    if clipping.max_norm not in (0.0, DEFAULT_CLIPPING):
        raise ValueError(
            f"sdp_gradient_clipping={clipping.max_norm:g} with shardpar's accelerate Accelerator: under accelerate "
            "the loop clips where it calls accelerator.clip_grad_norm_, as with DDP, and optimizer.step() does not "
            f"clip. Drop the knob and call accelerator.clip_grad_norm_(model.parameters(), {clipping.max_norm:g}) "
            "when accelerator.sync_gradients"
        )
    optimizer.set_clipping(0.0, ACCELERATE)


class ShardparOptimizer(AcceleratedOptimizer):
    """accelerate's wrapper around a DistributedOptimizer: no device placement (its state lives with the
    shards) and no GradScaler (shardpar scales fp16 losses itself); `step_was_skipped` is shardpar's."""

    def __init__(self, optimizer: DistributedOptimizer) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self._norm_outs: list[torch.Tensor] = []

    @property
    def step_was_skipped(self) -> bool:
        return bool(self.optimizer.skipped)

    def next_grad_norm(self) -> torch.Tensor:
        """A 0-d tensor the next `step()` fills with the global gradient norm it clipped by (before the
        clip, loss scale divided out): shardpar computes it inside the step, in the AllReduce that also
        decides the clip, so a caller that logs it after the step (the Trainer) pays nothing more."""
        out = torch.full((), float("nan"))
        self._norm_outs.append(out)
        return out

    def step(self, closure: Any = None) -> None:
        super().step(closure)
        if self.gradient_state.sync_gradients:
            norm = self.optimizer.last_grad_norm
            for out in self._norm_outs:
                out.copy_(norm.detach().float().cpu() if norm is not None else torch.tensor(float("nan")))
            self._norm_outs.clear()


def parameter_ids(model: DistributedModel) -> set[int]:
    """Every object that stands for one of `model`'s parameters: the one the user built (what an
    optimizer made before wrapping holds) and what `model.parameters()` yields (the same object until
    parameters keep their global shape outside forward, issue 20, which gives each its own)."""
    return {id(p) for p in model.parameters()} | {id(piece.param) for piece in model.sharded_state.pieces}


def shares_parameters(module: nn.Module, model: DistributedModel) -> bool:
    ours = parameter_ids(model)
    return any(id(p) in ours for p in module.parameters())


def optimizes(optimizer: torch.optim.Optimizer, model: DistributedModel) -> bool:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return bool(params) and owned(params, model)


def owned(params: list[torch.Tensor], model: DistributedModel) -> bool:
    """True when every tensor is one of `model`'s parameters, False when none is; a mix is refused."""
    ours = parameter_ids(model)
    mine = [id(p) in ours for p in params]
    if all(mine) and mine:
        return True
    if any(mine):
        raise ValueError(
            f"{sum(mine)} of {len(mine)} tensors are parameters of the shardpar model: pass all of model.parameters() "
            "(its gradients are clipped and stepped together) or none"
        )
    return False
