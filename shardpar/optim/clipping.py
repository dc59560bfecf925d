"""Who clips the gradients of a DistributedOptimizer, and by how much: `DistributedOptimizer.clipping`.

[Note: clipping belongs to the user's front end]
Each way of driving shardpar keeps its own framework's clipping, so a script clips as it did before:

  * the SMP API (`smp.init` + `smp.DistributedOptimizer`): `sdp_gradient_clipping` (reference 003's
    default 1.0) inside `optimizer.step()`;
  * the Trainer: `TrainingArguments.max_grad_norm` inside `optimizer.step()` (what transformers clips by);
  * accelerate: nothing inside `step()`; only where the loop calls `accelerator.clip_grad_norm_`, as
    under DDP.

Under any of them, a clip the user runs in the window -- `torch.nn.utils.clip_grad_norm_(model.parameters(),
max_norm)` (a norm of the gradients, then a change to them: runtime/user_params.py `GradClipWatch`),
`accelerator.clip_grad_norm_` or `optimizer.clip_master_grads` -- replaces the built-in clip for that
step: the gradients are never clipped twice.
"""

from __future__ import annotations

from dataclasses import dataclass

KNOB = "smp"  # sdp_gradient_clipping, the SMP API's
TRAINER = "trainer"  # TrainingArguments.max_grad_norm
ACCELERATE = "accelerate"  # only accelerator.clip_grad_norm_ / the user's own clip
OWNERS = (KNOB, TRAINER, ACCELERATE)


@dataclass(frozen=True)
class Clipping:
    """The clipping in force: `max_norm` is what `optimizer.step()` clips the global L2 gradient norm to
    (0: step() does not clip), `owner` whose rule set it (KNOB, TRAINER or ACCELERATE)."""

    max_norm: float
    owner: str = KNOB

    def __post_init__(self) -> None:
        if self.owner not in OWNERS:
            raise ValueError(f"Clipping(owner={self.owner!r}) must be one of {', '.join(OWNERS)}")
        if isinstance(self.max_norm, bool) or not isinstance(self.max_norm, (int, float)) or not self.max_norm >= 0:
            raise ValueError(f"Clipping(max_norm={self.max_norm!r}) must be a number >= 0 (0: no clipping in step())")

    @property
    def in_step(self) -> bool:
        """Whether `optimizer.step()` clips (unless a user clip ran in the window)."""
        return self.max_norm > 0

    def describe(self) -> str:
        """One line for logs, e.g. "sdp_gradient_clipping=1.0: optimizer.step() clips the global gradient norm
        to 1.0; ...", or accelerate's "only where the loop calls accelerator.clip_grad_norm_ ..."."""
        user = "; a clip_grad_norm_ in the window replaces it for that step"
        if self.owner == ACCELERATE:
            return "accelerate's: only where the loop calls accelerator.clip_grad_norm_ (none in optimizer.step())"
        name = "sdp_gradient_clipping" if self.owner == KNOB else "TrainingArguments.max_grad_norm"
        if not self.in_step:
            return f"{name}={self.max_norm}: no clipping in optimizer.step()"
        return f"{name}={self.max_norm}: optimizer.step() clips the global gradient norm to {self.max_norm}{user}"

    def __str__(self) -> str:
        return self.describe()
