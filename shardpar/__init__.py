"""shardpar: MiCS-style sharded data parallel training for PyTorch.

import shardpar as smp
smp.init({"sharded_data_parallel_degree": 2})

The facade: re-exports only (the names are defined in api/ and below; docs/design.md, "Layers").
"""

from typing import Any

from shardpar import amp, model, nn
from shardpar import api as _api
from shardpar.api import *  # noqa: F403  the smp names, listed in shardpar.api.__all__
from shardpar.checkpoint import CheckpointError
from shardpar.config import Config
from shardpar.topology import Plan, Topology, plan

__version__ = "0.1.0"

__all__ = [
    *_api.__all__,
    "CheckpointError",
    "Config",
    "Plan",
    "Topology",
    "__version__",
    "amp",
    "model",
    "nn",
    "plan",
]

# SMP v1 names shardpar does not provide, and what to use instead (docs/migration.md, "not provided"):
# still an AttributeError, but one that names the fix instead of Python's bare "has no attribute".
_NOT_PROVIDED = {
    "optimizers": "smp.optimizers (FusedLamb, FusedNovoGrad) is not provided: the optimizer steps per-rank pieces "
    "of each parameter, so use an element-wise torch optimizer (torch.optim.AdamW, Adam, SGD) inside "
    "smp.DistributedOptimizer",
    "hvd_average_grads": "smp.hvd_average_grads is Horovod's (TensorFlow); gradients are averaged by "
    "smp.DistributedModel's reducer, nothing to call",
}


def __getattr__(name: str) -> Any:
    if name in _NOT_PROVIDED:
        raise AttributeError(f"module 'shardpar' has no attribute {name!r}: {_NOT_PROVIDED[name]}")
    raise AttributeError(f"module 'shardpar' has no attribute {name!r}")
