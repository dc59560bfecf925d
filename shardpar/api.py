"""The `smp` facade: `init()`, rank queries and object collectives.

This is the ONE module with process-wide state (STYLE.md): `init()` fills `_STATE`; every core class
receives its topology, engine and config explicitly.
"""

from __future__ import annotations

import datetime
import enum
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardpar import checkpoint as _checkpoint
from shardpar.collectives import CommStats, CountingEngine, Engine, Group, make_engine
from shardpar.collectives.native import all_gather_object, broadcast_object
from shardpar.config import Config
from shardpar.deferred_init import deferred_init
from shardpar.model import DistributedModel as _DistributedModel
from shardpar.optimizer import DistributedOptimizer as _DistributedOptimizer
from shardpar.precision import make_loss_scaler
from shardpar.step import StepOutput, make_step
from shardpar.tensor_parallel.marks import ModuleMarks, TPOptions
from shardpar.tensor_parallel.marks import prepare_model as prepare_tensor_parallel
from shardpar.topology import Plan, Topology, plan


class CommGroup(enum.Enum):
    """Groups a user can address (the SageMaker v1 names, plus the two sharded-data-parallel ones)."""

    WORLD = "world"
    DP_GROUP = "world"  # pipeline_parallel_degree is always 1 here, so DP == WORLD
    PP_GROUP = "pp"
    TP_GROUP = "tp"
    MP_GROUP = "tp"  # model parallel = tp x pp, and pp is 1
    RDP_GROUP = "rdp"
    SDP_GROUP = "sharding"
    REPLICATION_GROUP = "replication"
    NODE_GROUP = "node"


@dataclass
class _State:
    config: Config
    plan: Plan
    topology: Topology
    engine: CountingEngine
    owns_default_group: bool
    local_rank: int
    local_size: int
    device: torch.device
    model: _DistributedModel | None = None
    optimizer: _DistributedOptimizer | None = None


_STATE: _State | None = None
# smp.register_parameter may run in a module's __init__, before or after init(): kept apart from _STATE.
_REGISTERED: weakref.WeakKeyDictionary[nn.Module, list[nn.Parameter]] = weakref.WeakKeyDictionary()
# smp.tensor_parallelism() marks modules while they are built, before init() may have run.
_TP_MARKS = ModuleMarks()


def init(config: Config | Mapping[str, Any] | str | os.PathLike[str] | None = None) -> Config:
    """Validate `config`, join (or start) the process group and build the topology and engine.

    `config` is a dict (flat or SageMaker's {"enabled": True, "parameters": {...}}), a JSON/TOML path,
    a `Config`, or None to read the environment. Runs as a world of one when no launcher set
    WORLD_SIZE. Every configuration error is raised before any process group is created.
    """
    global _STATE
    if _STATE is not None:
        raise RuntimeError("smp.init() was already called in this process; call smp.shutdown() first")
    cfg = Config.from_any(config)
    world, rank = _world_and_rank()
    cfg.check_world(world)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = _pick_device(local_rank)
    owns = _init_default_group(world, rank, cfg.collective_timeout_s, device)
    the_plan = plan(
        world, cfg.tensor_parallel_degree, cfg.sharded_data_parallel_degree, cfg.ranks_per_node or local_size
    )
    topology = Topology(the_plan, rank, timeout_s=cfg.collective_timeout_s)
    engine = CountingEngine(make_engine(cfg.ddp_dist_backend, timeout_s=cfg.collective_timeout_s))
    _STATE = _State(cfg, the_plan, topology, engine, owns, local_rank, local_size, device)
    return cfg


def shutdown() -> None:
    """Release the topology's process groups (and the default group if `init` created it)."""
    global _STATE
    if _STATE is None:
        return
    state, _STATE = _STATE, None
    if not dist.is_initialized():
        return
    seen: set[int] = set()
    for group in state.topology.groups.values():
        pg = group.handle
        if pg is None or pg is dist.group.WORLD or id(pg) in seen:
            continue
        seen.add(id(pg))
        dist.destroy_process_group(pg)
    if state.owns_default_group:
        dist.destroy_process_group()


def is_initialized() -> bool:
    return _STATE is not None


def _world_and_rank() -> tuple[int, int]:
    if "WORLD_SIZE" not in os.environ:
        if dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return 1, 0
    try:
        return int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
    except ValueError:
        raise ValueError(
            f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} / RANK={os.environ.get('RANK')!r} are not integers; "
            "launch with torchrun or unset them to run as a single process"
        ) from None


def _pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _init_default_group(world: int, rank: int, timeout_s: float, device: torch.device) -> bool:
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
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    return True


def state() -> _State:
    """The facade state; a clear error when `init` has not run."""
    if _STATE is None:
        raise RuntimeError("shardpar is not initialised: call smp.init(config) before using smp.* queries")
    return _STATE


# ---- rank queries (SageMaker v1 names) -----------------------------------------------------------


def rank() -> int:
    return state().topology.rank


def size() -> int:
    return state().plan.world


def local_rank() -> int:
    return state().local_rank


def local_size() -> int:
    return state().local_size


def dp_rank() -> int:
    return rank()


def dp_size() -> int:
    return size()


def rdp_rank() -> int:
    return state().topology.coords.rdp_rank


def rdp_size() -> int:
    return state().plan.rdp


def tp_rank() -> int:
    return state().topology.coords.tp_rank


def tp_size() -> int:
    return state().plan.tp


def sdp_rank() -> int:
    return state().topology.coords.sdp_rank


def sdp_size() -> int:
    return state().plan.sdp


def replica_rank() -> int:
    """Which sharding group (model replica) this rank belongs to."""
    return state().topology.coords.replica


def get_config() -> Config:
    return state().config


def get_topology() -> Topology:
    return state().topology


def get_engine() -> Engine:
    return state().engine


def comm_stats() -> CommStats:
    return state().engine.stats


def device() -> torch.device:
    return state().device


# ---- object collectives --------------------------------------------------------------------------


def _group(group: CommGroup) -> Group:
    if group is CommGroup.PP_GROUP:
        return Group("pp", (rank(),), state().topology.groups["world"].handle)
    return state().topology.group(group.value)


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    st = state()
    st.engine.barrier(_group(group))


def broadcast(obj: Any, group: CommGroup = CommGroup.WORLD, *, src: int | None = None) -> Any:
    """The object held by global rank `src` (default: the group's first rank), on every member."""
    g = _group(group)
    return broadcast_object(obj, g.ranks[0] if src is None else src, g)


def allgather(obj: Any, group: CommGroup = CommGroup.WORLD) -> list[Any]:
    """Every member's object, in group order."""
    return all_gather_object(obj, _group(group))


# ---- model, optimizer, step ----------------------------------------------------------------------


def register_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Make `param` (owned by another module) available, gathered, during `module`'s forward."""
    if not isinstance(param, nn.Parameter):
        raise TypeError(f"register_parameter needs an nn.Parameter, got {type(param).__name__}")
    params = _REGISTERED.setdefault(module, [])
    if all(p is not param for p in params):
        params.append(param)


def DistributedModel(
    module: nn.Module,
    *,
    backward_passes_per_step: int = 1,
    wrap: Sequence[type[nn.Module]] | Callable[[nn.Module], bool] | None = None,
    tensor_parallelism: bool = False,
) -> _DistributedModel:
    """Shard `module` over the sharding group (reference 003); returns the wrapped model.

    With `tensor_parallelism=True`, or for a model built under `smp.tensor_parallelism()`, the Hugging
    Face model's blocks and embeddings are first split in place over the TP group; each TP rank then
    shards its local parameters inside its sharding group (docs/tensor_parallelism.md).
    """
    st = state()
    if isinstance(module, _DistributedModel):
        raise ValueError("the module is already a DistributedModel; wrap the plain module once")
    module = prepare_tensor_parallel(
        module,
        requested=tensor_parallelism,
        marks=_TP_MARKS,
        config=st.config,
        topology=st.topology,
        engine=st.engine,
    )
    registered = {id(m): list(ps) for m, ps in _REGISTERED.items()}
    model = _DistributedModel(
        module.to(st.device) if not _has_meta_tensors(module) else module,
        config=st.config,
        topology=st.topology,
        engine=st.engine,
        backward_passes_per_step=backward_passes_per_step,
        wrap=wrap,
        registered=registered,
        device=st.device,
    )
    st.model = model
    return model


def _has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def tensor_parallelism(enabled: bool = True, *, vocab_parallel_loss: bool = False) -> AbstractContextManager[None]:
    """Modules built inside are split over the TP group when `smp.DistributedModel` wraps them
    (GPT-NeoX, Llama, GPT-2); nest `enabled=False` to keep a part replicated. `vocab_parallel_loss`:
    the LM head returns this rank's vocabulary slice of the logits and the model's loss is the
    vocab-parallel cross-entropy (otherwise the logits are all-gathered)."""
    return _TP_MARKS.building(TPOptions(enabled=enabled, vocab_parallel_loss=vocab_parallel_loss))


def delay_param_initialization() -> AbstractContextManager[None]:
    """Build a model inside this context to create no parameter memory: each rank later materialises
    only its shards (one full parameter at a time), with the values a normal init would give."""
    return deferred_init()


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    static_loss_scale: float = 1.0,
    dynamic_loss_scale: bool = False,
    dynamic_loss_args: dict[str, Any] | None = None,
    *,
    model: _DistributedModel | None = None,
) -> _DistributedOptimizer:
    """Re-point `optimizer` at the local main shards. Clipping (sdp_gradient_clipping) and, with fp16,
    loss scaling run inside step(): static, or dynamic with `dynamic_loss_args` keys init_scale,
    scale_factor, scale_window, min_scale, delayed_shift, consecutive_hysteresis."""
    st = state()
    model = model or st.model
    if model is None:
        raise ValueError("smp.DistributedOptimizer needs a model: call smp.DistributedModel(model) first")
    scaler = make_loss_scaler(
        model.policy,
        static_loss_scale=static_loss_scale,
        dynamic_loss_scale=dynamic_loss_scale,
        dynamic_loss_args=dynamic_loss_args,
    )
    opt = _DistributedOptimizer(optimizer, model, clip_norm=st.config.sdp_gradient_clipping, loss_scaler=scaler)
    st.optimizer = opt
    return opt


def step(fn: Callable[..., Any]) -> Callable[..., StepOutput]:
    """Decorator: run `fn` once per micro-batch (config `microbatches`) and return a StepOutput."""
    return make_step(
        fn,
        find_model=lambda: state().model,
        microbatches=lambda: state().config.microbatches,
    )


# ---- checkpoints ---------------------------------------------------------------------------------


def save_checkpoint(
    path: str | os.PathLike[str],
    tag: str,
    partial: bool = True,
    model: _DistributedModel | None = None,
    optimizer: _DistributedOptimizer | None = None,
    user_content: Any = None,
    translate_if_full: bool = True,
    num_kept_partial_checkpoints: int | None = None,
) -> None:
    """SMP v1 semantics: `partial=True` writes each shard once (replica 0), resumable under another
    topology; `partial=False` writes a Hugging Face directory. Atomic: `newest` moves last."""
    st = state()
    model = model or st.model
    if model is None:
        raise ValueError("smp.save_checkpoint needs a model: call smp.DistributedModel(model) first")
    _checkpoint.save_checkpoint(
        path,
        tag,
        model=model,
        optimizer=optimizer or st.optimizer,
        topology=st.topology,
        engine=st.engine,
        partial=partial,
        user_content=user_content,
        translate_if_full=translate_if_full,
        num_kept_partial_checkpoints=num_kept_partial_checkpoints,
    )


def resume_from_checkpoint(
    path: str | os.PathLike[str],
    tag: str | None = None,
    partial: bool = True,
    strict: bool = True,
    load_optimizer: bool = True,
) -> Any:
    """Load the checkpoint `tag` (None: the newest) into the model and optimizer built before this
    call, resharding when the topology changed; returns the saved user_content."""
    st = state()
    if st.model is None:
        raise ValueError("smp.resume_from_checkpoint needs the DistributedModel (and optimizer) built first")
    return _checkpoint.resume_from_checkpoint(
        path,
        tag,
        model=st.model,
        optimizer=st.optimizer,
        topology=st.topology,
        engine=st.engine,
        partial=partial,
        strict=strict,
        load_optimizer=load_optimizer,
    )
