"""`smp.model` (SMP v1's `smdistributed.modelparallel.torch.model`): the module of DistributedModel."""

from shardpar.api.wrappers import DistributedModel

__all__ = ["DistributedModel"]
