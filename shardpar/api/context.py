"""The `smp` facade: `init()`, rank queries and object collectives (model, optimizer, step and
checkpoint functions are in training.py).

This is the ONE module with process-wide state (docs/design.md section 23): `init()` fills `_STATE`; every core class
receives its topology, engine and config explicitly.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import sys
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from shardpar.api.activation_offload import ActivationOffloader
from shardpar.api.launch_env import init_default_group, local_rank_and_size, pick_device, world_and_rank
from shardpar.collectives import CommStats, CountingEngine, Engine, Group, make_engine
from shardpar.collectives.entry import EntryCheck, job_store
from shardpar.collectives.native import all_gather_object, broadcast_object
from shardpar.config import Config
from shardpar.config_v1 import warning_text as v1_warning_text
from shardpar.tensor_parallel.marks import ModuleMarks
from shardpar.topology import Plan, Topology, plan

if TYPE_CHECKING:
    from shardpar.optim.optimizer import DistributedOptimizer as _DistributedOptimizer
    from shardpar.runtime.model import DistributedModel as _DistributedModel


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
    pp_group: Any = None  # smp.get_pp_process_group(): this rank alone, made on first use (api/groups.py)
    p2p_sent: dict[int, int] = dataclasses.field(default_factory=dict)  # messages sent to each global rank
    p2p_received: dict[int, int] = dataclasses.field(default_factory=dict)  # messages taken from each
    entry: EntryCheck | None = None  # [Note: collective entry]: gathering calls check in first
    offloader: ActivationOffloader | None = None  # offload_activations: what checkpoints keep leaves the device


_STATE: _State | None = None
_LOG = logging.getLogger("shardpar")
# smp.register_parameter may run in a module's __init__, before or after init(): kept apart from _STATE.
_REGISTERED: weakref.WeakKeyDictionary[nn.Module, list[nn.Parameter]] = weakref.WeakKeyDictionary()
# smp.tensor_parallelism() marks modules while they are built, before init() may have run.
_TP_MARKS = ModuleMarks()
# smp.init calls in this process (every rank makes as many): the entry check's keys of one init never
# meet an earlier init's in the job's store ([Note: collective entry])
_INITS = [0]


def init(config: Config | Mapping[str, Any] | str | os.PathLike[str] | None = None) -> Config:
    """Validate `config`, join (or start) the process group and build the topology and engine.

    `config` is a dict (flat or SageMaker's {"enabled": True, "parameters": {...}}), a JSON/TOML path,
    a `Config` (taken as it is), or None. The environment (SM_HP_MP_PARAMETERS, SHARDPAR_CONFIG,
    SHARDPAR_<KNOB>) overrides the script's values key by key ([Note: config precedence], config.py;
    SageMaker v1 let SM_HP_MP_PARAMETERS win too). Runs as a world of one when no launcher set
    WORLD_SIZE. Every configuration error is raised before any process group is created.
    """
    global _STATE
    if _STATE is not None:
        raise RuntimeError("smp.init() was already called in this process; call smp.shutdown() first")
    cfg = Config.from_any(config)
    world, rank = world_and_rank()
    cfg.check_world(world)
    local_rank, local_size = local_rank_and_size(rank, world)
    # Pure arithmetic: a layout error is raised here, before any process group exists.
    the_plan = plan(
        world, cfg.tensor_parallel_degree, cfg.sharded_data_parallel_degree, cfg.ranks_per_node or local_size
    )
    device = pick_device(local_rank)
    owns = init_default_group(world, rank, cfg.collective_timeout_s, device)
    try:
        _check_same_config(cfg, the_plan.ranks_per_node, world)
    except ValueError:
        if owns:
            dist.destroy_process_group()
        raise
    topology = Topology(the_plan, rank, timeout_s=cfg.collective_timeout_s)
    engine = CountingEngine(
        make_engine(
            cfg.ddp_dist_backend,
            timeout_s=cfg.collective_timeout_s,
            ranks_per_node=the_plan.ranks_per_node,
            ag_scratch_bytes=cfg.smddp_ag_scratch_buffer_size_bytes,
            ag_sort_bytes=cfg.smddp_ag_sort_buffer_size_bytes,
            device_type=device.type,
            hierarchical_allgather=cfg.sdp_hierarchical_allgather,
        )
    )
    _STATE = _State(cfg, the_plan, topology, engine, owns, local_rank, local_size, device)
    _INITS[0] += 1
    _STATE.entry = EntryCheck(job_store(world), rank, range(world), cfg.collective_entry_timeout_s, _INITS[0])
    if cfg.offload_activations:
        _STATE.offloader = ActivationOffloader(cfg.activation_loading_horizon)
    if cfg.v1_notes and rank == 0:
        warnings.warn(v1_warning_text(cfg.v1_notes), stacklevel=2)
    if cfg.overrides and rank == 0:  # the environment won over the script ([Note: config precedence])
        _LOG.info("smp.init: the environment overrides the script's config: %s", "; ".join(cfg.overrides))
    return cfg


def _check_same_config(cfg: Config, ranks_per_node: int, world: int) -> None:
    """Every rank must run with the same knobs: ranks that plan different groups (a different sdp
    degree, or LOCAL_WORLD_SIZE on one host only) would call new_group and the collectives in another
    order and hang. One all_gather of the knobs, compared with rank 0's, so every rank raises the
    same error before any group is built."""
    if world == 1:
        return
    knobs = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "overrides"}  # where a value came from may differ
    mine = {**knobs, "ranks_per_node (or LOCAL_WORLD_SIZE)": ranks_per_node}
    everyone: list[Any] = [None] * world  # all_gather_object fills every entry
    dist.all_gather_object(everyone, mine)
    first = everyone[0]
    for rank, knobs in enumerate(everyone):
        differ = [k for k in mine if knobs[k] != first[k]]
        if differ:
            said = "; ".join(f"{k} is {first[k]!r} on rank 0 but {knobs[k]!r} on rank {rank}" for k in differ)
            raise ValueError(
                f"smp.init: every rank must use the same config: {said}. Pass the same config to every rank"
            )


def shutdown() -> None:
    """Release the process groups `init` and the group queries made (and the default group if `init`
    created it). A gloo group frees its threads and sockets when its last reference goes: a model or
    optimizer still referenced keeps its topology's groups until it is dropped."""
    global _STATE
    if _STATE is None:
        return
    from shardpar.checkpoint import async_save  # late: checkpoint imports this module's users

    # Not a collective here (some ranks may be leaving on an error): an async save nobody committed is
    # dropped, its writer given a minute; `newest` names the previous checkpoint.
    dropped = async_save.abandon_local()
    if dropped is not None:
        import warnings

        warnings.warn(
            f"smp.shutdown(): the async checkpoint {dropped!r} was never committed (call smp.wait_for_checkpoint() "
            "on every rank before shutdown); `newest` still names the previous checkpoint",
            stacklevel=2,
        )
    # A normal finish frees this rank's in-memory snapshots (RAM); on an error or a preemption exit (an
    # exception on its way out of the caller's `finally`) they stay for the next start to resume from.
    if sys.exc_info()[1] is None:
        from shardpar.checkpoint import snapshot

        snapshot.discard_written(_STATE.topology.rank)
    state, _STATE = _STATE, None
    close = getattr(state.engine.inner, "close", None)
    if close is not None:
        close()  # stop the engine's worker thread and unmap its shared memory now
    if not dist.is_initialized():
        return
    seen: set[int] = set()
    # pp_group: smp.get_pp_process_group() made it on first use; it is this facade's group as well.
    for pg in [*(group.handle for group in state.topology.groups.values()), state.pp_group]:
        if pg is None or pg is dist.group.WORLD or id(pg) in seen:
            continue
        seen.add(id(pg))
        dist.destroy_process_group(pg)
    if state.owns_default_group:
        dist.destroy_process_group()


def is_initialized() -> bool:
    return _STATE is not None


class _V1State:
    """SMP v1's `smp.state`, for what scripts (and transformers' v1 integration) read from it:
    `smp.state.cfg`, the config (`smp.state.cfg.sharded_data_parallel_degree`, `.fp16`, ...)."""

    @property
    def cfg(self) -> Config:
        return state().config


V1_STATE = _V1State()


def activation_offloader() -> ActivationOffloader | None:
    """The offloader checkpoints hand what they keep to, or None (offload_activations off, or no init)."""
    return _STATE.offloader if _STATE is not None else None


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
    if group != CommGroup.WORLD or st.entry is None:
        st.engine.barrier(_group(group))
        return
    # checked in: a rank skipping a gathering call meets the others here, and both sides are named
    with st.entry.call("smp.barrier()", "Call smp.barrier() on every rank."):
        st.engine.barrier(_group(group))


def broadcast_collective(obj: Any, group: CommGroup, src: int) -> Any:
    """The object held by global rank `src`, on every member: a collective every member calls
    (smp.broadcast with src=...; without src it is v1's sender-only broadcast, api/p2p.py)."""
    g = _group(group)
    if src not in g.ranks:
        raise ValueError(
            f"broadcast src={src} is not in this rank's {group.name} (global ranks {list(g.ranks)}); pass the "
            "global rank of a member"
        )
    return broadcast_object(obj, src, g)


def allgather(obj: Any, group: CommGroup = CommGroup.WORLD) -> list[Any]:
    """Every member's object, in group order."""
    return all_gather_object(obj, _group(group))
