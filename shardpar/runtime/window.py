"""The gradient-accumulation window: which backward ends it, and what the backwards are scaled by.

A window is `backward_passes_per_step` backward passes, times smp.step's micro-batches while a step
runs; the replication AllReduce runs in the backward that ends it, and only then may the optimizer
step or a partial checkpoint be saved. The backwards of the open window are counted, not derived from
`num_backward`: the micro-batch count is known only while smp.step runs, and a resumed run may use
another (a resumed run starts a window of its own).

    begin_backward() -> ends_window      (the backward's first gradient, hooks.py)
    end_backward()                       (the end-of-backward callback)
    no_sync()                            (DDP's no_sync: [Note: no_sync] below)
    reset()                              (zero_grad: the window's gradients are dropped)
    use_scaler(scaler)                   (the optimizer's loss scaler: `loss_scale` reads it)
    check_step() / check_save(...)       (refuse a step or a save inside a window)

[Note: no_sync]
`model.no_sync()` means what DDP's does: a backward inside it never ends the window (no replication
AllReduce), and the first backward outside it after such a backward does, whatever
`backward_passes_per_step` counts -- DDP syncs the first backward outside. Under smp.step that is the
step's last micro-batch (the step's micro-batches are one batch). accelerate's `no_sync(model)` and
`accumulate(model)` come here, so a loop that calls `loss.backward()` itself inside them accumulates
exactly as under DDP.

One owner: the model's hooks, smp.step, the optimizer and the checkpoints use it through these
methods; nothing else writes its fields.

[Note: one owner of the loss scale]
The fp16 loss scale is the DistributedOptimizer's loss scaler's (optim/loss_scaling.py): it changes it
(an overflow halves it, clean steps grow it, a resume loads it). The window holds that scaler, not a
copy of its scale, so `model.backward` and the step read the same number without anything keeping two
in step. Before an optimizer is attached the scale is a fixed 1.0 (`FixedScale`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class ScaleSource(Protocol):
    """What the window reads the loss scale from: a loss scaler (optim/loss_scaling.py) or `FixedScale`."""

    loss_scale: float


class FixedScale:
    """The scale of a model without an optimizer attached (or set through `model.loss_scale`)."""

    def __init__(self, loss_scale: float = 1.0) -> None:
        self.loss_scale = loss_scale


class AccumulationWindow:
    def __init__(self, backward_passes_per_step: int, *, average_microbatches: bool = True) -> None:
        self._per_step = _checked(backward_passes_per_step)
        # SMP v1's average_grads_across_microbatches: False sums the micro-batches' gradients (for a
        # loss that sums over samples instead of averaging).
        self._average = average_microbatches
        self._microbatches = 1  # of the running smp.step
        self._done = 0  # backward passes of the open window
        self._length = self._per_step  # the window's length at its last backward
        self._ends = False  # whether the running backward ends the window
        self._num_backward = 0  # every backward pass so far (informational)
        self._scaler: ScaleSource = FixedScale()  # the optimizer's ([Note: one owner of the loss scale])
        self._no_sync = 0  # depth of no_sync() contexts ([Note: no_sync])
        self._deferred = False  # a backward of the open window ran inside no_sync()
        self._micro_done = 0  # backward passes of the running smp.step

    # ---- reads ----------------------------------------------------------------------------------

    @property
    def backward_passes_per_step(self) -> int:
        return self._per_step

    @property
    def num_backward(self) -> int:
        return self._num_backward

    @property
    def num_done(self) -> int:
        """Backward passes of the open window so far (0 after a boundary or `reset`): integrations that
        follow another library's accumulation signal (accelerate's `sync_gradients`) place the boundary
        with it."""
        return self._done

    @property
    def loss_scale(self) -> float:
        """What `model.backward` multiplies the loss by (the optimizer divides it out again): the
        scaler's current scale ([Note: one owner of the loss scale])."""
        return self._scaler.loss_scale

    @property
    def scaler(self) -> ScaleSource:
        return self._scaler

    @property
    def grad_scale(self) -> float:
        """The factor a backward's gradients enter the main grads with: 1 / micro-batches of the running
        smp.step ([Note: micro-batch averaging] in model.py), or 1 when micro-batches are summed."""
        return 1.0 / self._microbatches if self._average else 1.0

    @property
    def in_no_sync(self) -> bool:
        """Inside `no_sync()`: backwards accumulate without ending the window."""
        return self._no_sync > 0

    @property
    def ends_window(self) -> bool:
        """Whether the running (or last) backward ends the window."""
        return self._ends

    # ---- changes --------------------------------------------------------------------------------

    def set_backward_passes_per_step(self, backward_passes_per_step: int) -> None:
        """Takes effect from the next backward (the open window is measured with it)."""
        self._per_step = _checked(backward_passes_per_step)

    def use_scaler(self, scaler: ScaleSource) -> None:
        """From now on the loss scale is `scaler`'s (the optimizer attaching its loss scaler)."""
        self._scaler = scaler

    @contextmanager
    def in_step(self, microbatches: int) -> Iterator[None]:
        """smp.step's micro-batches: each backward inside is 1/microbatches of the window's gradient."""
        self._microbatches, self._micro_done = microbatches, 0
        try:
            yield
        finally:
            self._microbatches, self._micro_done = 1, 0

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's no_sync ([Note: no_sync])."""
        self._no_sync += 1
        try:
            yield
        finally:
            self._no_sync -= 1

    def begin_backward(self) -> bool:
        """A backward starts: returns whether it ends the window."""
        self._length = self._per_step * self._microbatches
        if self._no_sync:
            self._deferred = True
            self._ends = False
        elif self._deferred:  # the first backward outside no_sync (the running step's last micro-batch)
            self._ends = self._micro_done + 1 >= self._microbatches
        else:
            self._ends = self._done + 1 >= self._length
        return self._ends

    def end_backward(self) -> None:
        self._num_backward += 1
        self._micro_done += 1
        self._done = 0 if self._ends else self._done + 1
        if self._ends:
            self._deferred = False

    def reset(self) -> None:
        """The window's gradients were dropped (zero_grad): the next backward starts a window (one
        abandoned after an error would otherwise end off the user's count)."""
        self._done = 0
        self._deferred = False

    # ---- refusals -------------------------------------------------------------------------------

    def check_step(self) -> None:
        """Refuse a step inside an accumulation window, before anything changes: the main grads are
        partial sums not yet AllReduced over the replication group, so the replicas would diverge."""
        done, window, per_step = self._done, self._length, self._per_step
        if done and self._deferred:
            raise ValueError(
                f"optimizer.step() after {done} backward passes inside model.no_sync(): their gradients are not "
                "reduced over the replication group until a backward outside no_sync() ends the window (DDP's "
                "rule). Run the window's last backward outside no_sync(), then step()"
            )
        if done:
            micro = f" x {window // per_step} micro-batches" if window > per_step else ""
            raise ValueError(
                f"optimizer.step() after {done} of the {window} backward passes of an accumulation window "
                f"(backward_passes_per_step={per_step}{micro}): the gradients are not reduced over the "
                f"replication group until the window ends. Call step() after every {window} backward passes, "
                "or lower backward_passes_per_step"
            )

    def check_save(self, what: str, lost: str) -> None:
        """Refuse `what` (a partial save, a resume) inside a window, whose gradients `lost`."""
        done = self._done
        if done:  # alike on every rank: they run the same backwards
            raise ValueError(
                f"{what} inside an accumulation window: {done} of its {self._length} backward passes have run, and "
                f"their accumulated gradients {lost} after optimizer.step()"
            )


def _checked(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:  # 1.5 would never reach a window's end
        raise ValueError(f"backward_passes_per_step={k!r} must be an integer >= 1 (backward passes per step)")
    return k
