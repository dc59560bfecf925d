"""`smp.amp.GradScaler` (SMP v1): v1's torch.cuda.amp.GradScaler that agreed on overflows across ranks.

Here fp16 loss scaling belongs to smp.DistributedOptimizer (config `fp16`, `dynamic_loss_scale=True`): it
scales what `model.backward(loss)` back-propagates, divides it out of the fp32 main grads, and skips an
overflowed step on every rank. A second scale on top would be divided out by no one, so this scaler
passes the loss through, steps the optimizer, and leaves the scale to it; one rank-0 log line says so.
Scripts written `model.backward(scaler.scale(loss))`, `scaler.step(optimizer)`, `scaler.update()` run
unchanged."""

from __future__ import annotations

from typing import Any

from shardpar.v1_notes import note_once


class GradScaler:
    """SMP v1's `smp.amp.GradScaler(init_scale=..., growth_factor=..., ...)`: its arguments are accepted;
    the loss scale is smp.DistributedOptimizer's (module docstring)."""

    def __init__(self, *args: Any, enabled: bool = True, **kwargs: Any) -> None:
        self._enabled = enabled
        note_once(
            "smp.amp.GradScaler",
            "fp16 loss scaling is smp.DistributedOptimizer's (dynamic_loss_scale=True); this scaler's scale() "
            "returns the loss unchanged (model.backward applies the optimizer's scale), step() calls "
            "optimizer.step() (which skips an overflowed step), update() changes nothing",
        )

    def scale(self, outputs: Any) -> Any:
        return outputs

    def unscale_(self, optimizer: Any) -> None:
        """The optimizer divides the loss scale out of the main grads inside its step."""

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        if new_scale is not None:
            raise ValueError(
                f"smp.amp.GradScaler.update(new_scale={new_scale!r}): the loss scale is smp.DistributedOptimizer's; "
                "pass static_loss_scale= (or dynamic_loss_args={'init_scale': ...}) to smp.DistributedOptimizer"
            )

    def get_scale(self) -> float:
        from shardpar.api.context import state  # the facade's optimizer, looked up when asked

        optimizer = state().optimizer
        return float(optimizer.loss_scaler.loss_scale) if optimizer is not None else 1.0

    def is_enabled(self) -> bool:
        return self._enabled

    def state_dict(self) -> dict[str, Any]:
        """Empty: the scale is saved with the optimizer (smp.save_checkpoint / optimizer.state_dict())."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load: the optimizer's state_dict carries the scale."""
