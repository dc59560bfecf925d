"""One gate before the fp32 main values or the optimizer state are written.

[Note: writes wait for staging]
An async checkpoint (checkpoint/async_save.py) copies this rank's main shards and optimizer state
into its staging buffers on the writer thread, while the next forward and backward run: they read
the main shards (through the compute copies and the gathers) and write only gradients. Whatever
would *write* a tensor the copy is still reading must wait for it, or the checkpoint holds a mix of
two steps. Those writers are few, and every one passes here first:

  * `DistributedOptimizer.step()` (the inner optimizers, owner compute's re-read of its whole values);
  * loads: `model.load_state_dict`, `local_state_dict` loads, `optimizer.load_state_dict`,
    `set_model_state_dict` / `set_optimizer_state_dict` (dcp_state_dict.py), and the sharded state
    dicts of `get_state_dict`, whose zero-copy views `dcp.load` writes into;
  * in-place ops on the user parameters (`p.mul_()`, `p.copy_()`, `p.data = ...`, a plain torch
    optimizer on `model.parameters()`): ShardedTensor's dispatch calls its layout's `before_write`
    before the op runs, the twin of `on_write` (ShardedState.mark_written) that runs after it.

Writes that bypass all of these -- into `p.local_piece`, `p.ds_tensor` or a state tensor taken from
`optimizer.state` -- are not seen, as `mark_written` does not see them either.

The checkpoint layer registers its wait here (runtime must not import it, docs/design.md "Layers")
and clears it once the copy is done, so a write in the common case costs one None check.
"""

from __future__ import annotations

from collections.abc import Callable

_waiter: Callable[[str], None] | None = None


def set_waiter(waiter: Callable[[str], None] | None) -> None:
    """Install (or with None remove) what `before_write` calls: it returns once writing is safe, or raises."""
    global _waiter
    _waiter = waiter


def before_write(what: str) -> None:
    """Called before `what` (named in the waiter's error) writes main values or optimizer state."""
    waiter = _waiter
    if waiter is not None:
        waiter(what)
