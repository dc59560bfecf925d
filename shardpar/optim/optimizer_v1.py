"""DistributedOptimizer's SageMaker model parallel v1 surface beyond torch.optim's: the local state dict,
`_global_grad_norm`, and the DeepSpeed attributes v1's sharded data parallelism exposed
(runtime/deepspeed_views.py). docs/migration.md lists each name.

A mixin, listed before torch.optim.Optimizer in DistributedOptimizer's bases (optim/optimizer.py); it
owns none of the attributes it reads -- DistributedOptimizer.__init__ sets them."""

from __future__ import annotations

from typing import Any

import torch

from shardpar.optim.sharded_state import FlatPartitions, OptimizerState
from shardpar.v1_notes import note_once


class OptimizerV1Mixin:
    # Set by DistributedOptimizer.__init__ (optim/optimizer.py).
    view: OptimizerState
    last_grad_norm: torch.Tensor | None
    optimizer: torch.optim.Optimizer

    # Declared for the type checker only: DistributedOptimizer defines both, and comes first in the MRO.
    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def _originals(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError

    def local_state_dict(self, cast_to_cpu: bool = False, gather_if_shard: bool = True) -> dict[str, Any]:
        """SMP v1: this rank's optimizer state (`state_dict()` is already this rank's), marked partial.
        `gather_if_shard` (v1: gather shard_optimizer_state's pieces to rdp rank 0) changes nothing: each
        rank keeps its own piece, and smp.save_checkpoint writes every piece and reshards them on resume.
        `cast_to_cpu` moves the tensors to the CPU."""
        if gather_if_shard and self.view.shard_optimizer_state:
            note_once(
                "optimizer.local_state_dict(gather_if_shard=True)",
                "each rank's dict holds its own piece of the sharded optimizer state (nothing is gathered to rdp "
                "rank 0); smp.save_checkpoint saves every piece and resumes at any topology",
            )
        state = {**self.state_dict(), "_smp_is_partial": True}
        return _to_cpu(state) if cast_to_cpu else state

    @property
    def _global_grad_norm(self) -> torch.Tensor | None:
        """SMP v1 / DeepSpeed: the global L2 norm of the gradients at the last step (after the loss scale
        was divided out, before clipping); None before the first step. shardpar's name: last_grad_norm."""
        return self.last_grad_norm

    @property
    def ds_param_shard_group(self) -> Any:
        """SMP v1 / DeepSpeed: the torch.distributed process group the parameters' partitions split over."""
        return self.view.shard_process_group()

    @property
    def fp32_partitioned_groups_flat(self) -> list[FlatPartitions]:
        """SMP v1 / DeepSpeed: per param group, the fp32 main partitions of its parameters end to end, in
        the group's order, each as long as that parameter's `p.ds_tensor.ds_numel`: live views of the fp32
        main shards (deepspeed_views.FlatPartitions)."""
        user_of = {id(piece): u for u, piece in self._originals()}  # the ShardedTensors
        return [
            self.view.fp32_partitions([user_of[id(p)] for p in group["params"]])
            for group in self.optimizer.param_groups
        ]


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
