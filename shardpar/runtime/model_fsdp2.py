"""DistributedModel's FSDP2 surface: `unshard()` / `reshard()` as `FSDPModule` has them
(torch/distributed/fsdp/_fully_shard/_fully_shard.py). A parameter's own `full_tensor()` is
ShardedTensor's (sharded_tensor.py); the torch.distributed.checkpoint.state_dict functions are
checkpoint/torch_state_dict.py's.

FSDP2's `unshard()` AllGathers the parameters (in the compute dtype of its MixedPrecisionPolicy) and
registers the unsharded ones on the modules until `reshard()`, or until the module's next forward
reshards it after use. Here one DistributedModel stands for the whole tree of FSDP modules, so
`unshard()` gathers every unit (compute dtype: bf16/fp16 copies under mixed precision) and the modules
hold the compute parameters, whole; the next forward frees each unit after its own forward as usual
(the root, while a graph is recorded, after the backward), an optimizer step frees them all, and so
does `reshard()`. Values written into the unsharded parameters are not kept (as with FSDP2: write the
sharded parameters, or load_state_dict).

A mixin, listed before nn.Module in DistributedModel's bases (runtime/model.py); it owns none of the
attributes it reads -- DistributedModel.__init__ sets them."""

from __future__ import annotations

import torch
from torch import nn

from shardpar.runtime.schedule import Scheduler
from shardpar.runtime.state import ShardedState
from shardpar.runtime.unit import Unit
from shardpar.runtime.user_params import UserParams


class UnshardHandle:
    """What `unshard(async_op=True)` returns (FSDP2's UnshardHandle): the gather is already complete
    here, so `wait()` has nothing left to do."""

    def wait(self) -> None:
        return None


class FSDP2Mixin(nn.Module):
    """`unshard` / `reshard` of a DistributedModel (see the module docstring)."""

    # Set by DistributedModel.__init__ (runtime/model.py).
    units: list[Unit]
    scheduler: Scheduler
    user_params: UserParams
    sharded_state: ShardedState

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather every unit and let the modules hold the whole (compute) parameters until `reshard()`,
        the next forward, or an optimizer step. A collective: every rank calls it."""
        _refuse_in_backward("unshard")
        self.sharded_state.refresh_if_written()  # main values a plain optimizer wrote reach the compute copies
        self.scheduler.hold_all()
        for unit in self.units:
            self.user_params.enter(unit)
        return UnshardHandle() if async_op else None

    def reshard(self) -> None:
        """Free what `unshard()` gathered; the modules hold the sharded parameters again."""
        _refuse_in_backward("reshard")
        self.user_params.reset()
        self.scheduler.release_all()


def _refuse_in_backward(name: str) -> None:
    if torch._C._current_graph_task_id() != -1:
        raise RuntimeError(
            f"model.{name}() inside a backward pass: the units a backward needs are gathered and freed by "
            f"shardpar's hooks; call {name}() before the forward or after the backward"
        )
