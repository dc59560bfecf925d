"""Autograd pieces of a unit's backward that the model's hooks install: the end of a borrowing call's
backward (its holds on the units it borrows from end there, [Note: holders] in unit.py), and the
error for a gradient that arrives after the unit was reduced."""

from __future__ import annotations

from typing import Any

import torch

from shardpar.runtime.unit import Unit


class _CallBackwardDone(torch.autograd.Function):
    """Identity on a forward call's tensor inputs; its backward runs once the gradients of all of them
    are computed -- the call's whole backward has run -- and before they flow on to whoever produced
    the inputs (FSDP2 puts its post-backward in the same place)."""

    @staticmethod
    def forward(ctx: Any, unit: Unit, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        unit = ctx.unit
        unit.borrow_calls -= 1
        if unit.borrow_calls == 0:
            unit.release_borrowed()
        return (None, *grads)


def after_backward_of_call(unit: Unit, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """A forward call of a unit that borrows parameters: route its positional tensor inputs through
    _CallBackwardDone, so that its backward holds on the lenders end with its backward ([Note:
    holders] in unit.py). Without such inputs the holds last to the end of the backward."""
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not positions:
        return None
    unit.borrow_calls += 1
    passed = _CallBackwardDone.apply(unit, *(args[i] for i in positions))
    out = list(args)
    for i, t in zip(positions, passed, strict=True):
        out[i] = t
    return tuple(out)


def late_gradient(unit: Unit, p: torch.Tensor) -> RuntimeError:
    """A gradient for a unit whose gradients this backward already reduced: it would be left on .grad,
    never reduced, and added into the next step's gradient."""
    name = next((s.fqn for q, s in zip(unit.params, unit.layout.specs, strict=True) if q is p), "?")
    return RuntimeError(
        f"{name} (unit {unit.name}) got a gradient after the unit's gradients were reduced in this backward. "
        "The unit ran more than once inside reentrant activation checkpointing "
        "(torch.utils.checkpoint(..., use_reentrant=True)), whose nested backwards deliver each use's "
        "gradient apart; checkpoint it with use_reentrant=False, as PyTorch recommends"
    )
