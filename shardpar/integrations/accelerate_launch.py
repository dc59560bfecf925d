"""What shardpar's `Accelerator` refuses before accelerate sets anything up (its process group, device,
plugins): another sharding backend, and a launch whose process count accelerate and shardpar would not
agree on. Each refusal names the value, the rule and the fix, on every rank alike.

[Note: process counts under accelerate launch]
shardpar runs on the processes the launcher started (WORLD_SIZE, or the MPI variables accelerate reads);
accelerate must see the same number. How each `accelerate launch` form starts a script on CPUs
(accelerate 1.x, commands/launch.py):

  * `--multi_gpu --num_processes N` (torchrun underneath), or torchrun itself: N processes; accelerate
    counts them only on CPUs told so (ACCELERATE_USE_CPU=1 in the environment, or
    `Accelerator(cpu=True)`); otherwise each process is a world of one to accelerate -- refused here;
  * `--cpu --num_processes N` or no flag without GPUs: the simple launcher, ONE process (it starts N
    only through MPI, `--mpirun_hostfile`). Plain accelerate then trains one process, and so does
    shardpar; a shardpar config that needs more ranks is refused here, with the command that starts N;
  * `--cpu --mpirun_hostfile H --num_processes N`: N MPI processes; accelerate (cpu) counts them, and
    WORLD_SIZE is set by accelerate before shardpar reads it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from accelerate.state import PartialState
from accelerate.utils import parse_flag_from_env

from shardpar.config import Config

_PLUGINS = ("fsdp_plugin", "deepspeed_plugin", "megatron_lm_plugin")  # Accelerator arguments
_ENV_PLUGINS = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_MEGATRON_LM")  # accelerate launch
# The launchers' world-size variables, in accelerate's order (utils/environment.get_cpu_distributed_information).
_WORLD_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
START_N = (
    "`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N train.py` (torchrun underneath; "
    "ACCELERATE_USE_CPU=1 runs the N processes on the CPU) or `ACCELERATE_USE_CPU=1 torchrun --nproc-per-node N "
    "train.py`"
)


def check_before_accelerate(kwargs: Mapping[str, Any], config: Config | None) -> None:
    """Refuse, before `accelerate.Accelerator.__init__` runs, what shardpar cannot train with.
    `kwargs`: the Accelerator's keyword arguments; `config`: the shardpar config given to it, or
    None when `smp.init` ran before (it then already agreed with the launch)."""
    foreign = [f"{name}=..." for name in _PLUGINS if kwargs.get(name) is not None]
    foreign += [f"{var}={os.environ[var]}" for var in _ENV_PLUGINS if parse_flag_from_env(var)]
    if foreign:
        raise ValueError(
            f"Accelerator with {', '.join(foreign)}: that plugin and shardpar would both shard the model. Drop it "
            "(accelerate launch without --use_fsdp / --use_deepspeed, and unset ACCELERATE_USE_FSDP / "
            "ACCELERATE_USE_DEEPSPEED): shardpar's sharded_data_parallel_degree replaces it"
        )
    if kwargs.get("parallelism_config") is not None:
        raise ValueError(
            "Accelerator(parallelism_config=...) is accelerate's own N-D parallelism; shardpar brings its own "
            "(sharded_data_parallel_degree, tensor_parallel_degree): drop parallelism_config"
        )
    launched = launched_processes()
    seen = accelerate_processes(bool(kwargs.get("cpu", False)), launched)
    if seen is not None and seen != launched:
        raise ValueError(
            f"the launcher started {launched} processes but accelerate would see {seen}: without CUDA, accelerate "
            "counts a launch's processes only on CPUs it was told to use, and would train each process alone. Set "
            "ACCELERATE_USE_CPU=1 in the launch environment (no change to the script), or pass Accelerator(cpu=True) "
            "(TrainingArguments(use_cpu=True) for the Trainer), as for DDP on CPUs"
        )
    if config is not None and launched == 1 and _simple_launcher_asked_for_more():
        need = config.sharded_data_parallel_degree * config.tensor_parallel_degree
        if need > 1:
            raise ValueError(
                f"accelerate launch started this script as 1 process (without --multi_gpu its launcher runs one "
                f"process on CPUs, whatever --num_processes says, unless MPI is set up with --mpirun_hostfile), but "
                f"sharded_data_parallel_degree={config.sharded_data_parallel_degree} x tensor_parallel_degree="
                f"{config.tensor_parallel_degree} needs {need} ranks or a multiple. Start N processes with {START_N}"
            )


def launched_processes() -> int:
    """The processes the launcher started, as accelerate and shardpar read them."""
    for var in _WORLD_VARS:
        value = os.environ.get(var)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{var}={value!r} is not an integer; launch with torchrun or unset it") from None
    return 1


def accelerate_processes(cpu: bool, launched: int) -> int | None:
    """How many processes accelerate's state will count, when that can be told before it starts: the
    state's own count once it exists; 1 for a CPU launch that accelerate was not told runs on CPUs
    (state.py `_prepare_backend`); None where a device decides (accelerate then counts the launch)."""
    if PartialState._shared_state:
        return int(PartialState().num_processes)
    if cpu or parse_flag_from_env("ACCELERATE_USE_CPU") or launched == 1:
        return launched
    if torch.accelerator.is_available():
        return None
    return 1


def _simple_launcher_asked_for_more() -> bool:
    """accelerate's simple launcher sets ACCELERATE_USE_CPU, and MASTER_ADDR only when --num_processes
    (or --num_machines) asked for more than one; torchrun and MPI set the world-size variables instead."""
    return "ACCELERATE_USE_CPU" in os.environ and "MASTER_ADDR" in os.environ and "LOCAL_RANK" not in os.environ
