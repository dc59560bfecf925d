"""What the launcher gave this process (smp.init, context.py): the world size and rank (torchrun's or
MPI's variables), the local rank, the device, and the default process group with its store."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def local_rank_and_size(rank: int, world: int) -> tuple[int, int]:
    """LOCAL_RANK / LOCAL_WORLD_SIZE as torchrun sets them (defaults: one node holding every rank)."""
    values = {
        "LOCAL_RANK": os.environ.get("LOCAL_RANK", str(rank)),
        "LOCAL_WORLD_SIZE": os.environ.get("LOCAL_WORLD_SIZE", str(world)),
    }
    try:
        return int(values["LOCAL_RANK"]), int(values["LOCAL_WORLD_SIZE"])
    except ValueError:
        raise ValueError(
            f"LOCAL_RANK={values['LOCAL_RANK']!r} / LOCAL_WORLD_SIZE={values['LOCAL_WORLD_SIZE']!r} must be integers; "
            "launch with torchrun (which sets them) or unset them"
        ) from None


# The launchers' world size and rank: torchrun's, then MPI's, in accelerate's order -- `accelerate launch
# --cpu --mpirun_hostfile H` starts N processes with only these (integrations/accelerate_launch.py), and
# smp.init may run before accelerate copies them to WORLD_SIZE / RANK.
_LAUNCHER_VARS = (
    ("WORLD_SIZE", "RANK"),
    ("PMI_SIZE", "PMI_RANK"),
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"),
)


def world_and_rank() -> tuple[int, int]:
    """The launcher's world size and this rank (the default group's when no launcher set them; one
    process otherwise)."""
    found = next(((w, r) for w, r in _LAUNCHER_VARS if w in os.environ), None)
    if found is None:
        if dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return 1, 0
    world_var, rank_var = found
    try:
        return int(os.environ[world_var]), int(os.environ.get(rank_var, "0"))
    except ValueError:
        raise ValueError(
            f"{world_var}={os.environ.get(world_var)!r} / {rank_var}={os.environ.get(rank_var)!r} are not integers; "
            "launch with torchrun or unset them to run as a single process"
        ) from None


def pick_device(local_rank: int) -> torch.device:
    """This rank's GPU (set as the current one) by its local rank, or the CPU."""
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_default_group(world: int, rank: int, timeout_s: float, device: torch.device) -> bool:
    """Start the default process group unless the user (or a test harness) already did."""
    if dist.is_initialized():
        if dist.get_world_size() != world:
            raise RuntimeError(f"default process group has {dist.get_world_size()} ranks, WORLD_SIZE says {world}")
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if world == 1 and "MASTER_ADDR" not in os.environ:
        # No launcher: a private in-process store, no network.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise ValueError(f"WORLD_SIZE={world} but {var} is not set; launch with torchrun")
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, store=_attempt_store(timeout))
    return True


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun's agent store, a store whose keys are this restart attempt's alone; else None (env://).

    [Note: stale keys after a torchrun restart]
    torchrun --max-restarts N keeps one TCPStore (the agent's) across attempts, and the env:// default group
    of this torch leaves the previous attempt's gloo addresses in it: a rank of the restarted attempt that
    reads its peer's key before the peer wrote it anew connects to the dead process's port ("Gloo
    connectFullMesh failed ... Connection refused"; reproduced with plain torch by delaying one rank of the
    second attempt by 5 s). A prefix per attempt (TORCHELASTIC_RESTART_COUNT) keeps each attempt's keys apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/shardpar/attempt_{attempt}", store)
