"""shardpar: MiCS-style sharded data parallel training for PyTorch.

import shardpar as smp
smp.init({"sharded_data_parallel_degree": 2})
"""

from shardpar.api import (
    CommGroup,
    allgather,
    barrier,
    broadcast,
    comm_stats,
    device,
    dp_rank,
    dp_size,
    get_config,
    get_engine,
    get_topology,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    rdp_rank,
    rdp_size,
    replica_rank,
    sdp_rank,
    sdp_size,
    shutdown,
    size,
    tp_rank,
    tp_size,
)
from shardpar.checkpoint import CheckpointError
from shardpar.config import Config
from shardpar.step import StepOutput
from shardpar.topology import Plan, Topology, plan
from shardpar.training import (
    DistributedModel,
    DistributedOptimizer,
    delay_param_initialization,
    register_parameter,
    resume_from_checkpoint,
    save_checkpoint,
    step,
    tensor_parallelism,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CommGroup",
    "Config",
    "DistributedModel",
    "DistributedOptimizer",
    "Plan",
    "StepOutput",
    "Topology",
    "__version__",
    "allgather",
    "barrier",
    "broadcast",
    "comm_stats",
    "delay_param_initialization",
    "device",
    "dp_rank",
    "dp_size",
    "get_config",
    "get_engine",
    "get_topology",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "plan",
    "rank",
    "rdp_rank",
    "rdp_size",
    "register_parameter",
    "replica_rank",
    "resume_from_checkpoint",
    "save_checkpoint",
    "sdp_rank",
    "sdp_size",
    "shutdown",
    "size",
    "step",
    "tensor_parallelism",
    "tp_rank",
    "tp_size",
]
