"""shardpar: MiCS-style sharded data parallel training for PyTorch.

import shardpar as smp
smp.init({"sharded_data_parallel_degree": 2})

The facade: re-exports only (the names are defined in api/ and below; docs/design.md, "Layers").
"""

from shardpar import api as _api
from shardpar import nn
from shardpar.api import *  # noqa: F403  the smp names, listed in shardpar.api.__all__
from shardpar.checkpoint import CheckpointError
from shardpar.config import Config
from shardpar.topology import Plan, Topology, plan

__version__ = "0.1.0"

__all__ = [*_api.__all__, "CheckpointError", "Config", "Plan", "Topology", "__version__", "nn", "plan"]
