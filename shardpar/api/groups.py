"""SageMaker model-parallel v1's rank types, group queries and process-group handles.

With `pipeline_parallel_degree` 1 (the only value here) v1's groups are:

    PP_GROUP   this rank alone                     pp_rank() 0, pp_size() 1
    TP_GROUP   the tensor-parallel group
    MP_GROUP   tp x pp = the TP group              mp_rank() = tp_rank()
    DP_GROUP   every rank with this pp_rank = WORLD
    RDP_GROUP  the ranks holding the same TP slice (reduced data parallel)
"""

from __future__ import annotations

import enum

import torch.distributed as dist

from shardpar.api.context import CommGroup, barrier, rank, size, state, tp_rank, tp_size
from shardpar.collectives import Group


class RankType(enum.Enum):
    """How a rank number passed to `smp.send` / `smp.recv_from` is read: within which group."""

    WORLD_RANK = "world_rank"
    MP_RANK = "mp_rank"
    PP_RANK = "pp_rank"
    TP_RANK = "tp_rank"
    DP_RANK = "dp_rank"
    RDP_RANK = "rdp_rank"

    @property
    def group_kind(self) -> str:
        """The topology group the rank number counts in."""
        return _KIND_OF[self]


_KIND_OF = {
    RankType.WORLD_RANK: "world",
    RankType.MP_RANK: "tp",  # model parallel = tp x pp, and pp is 1
    RankType.PP_RANK: "pp",
    RankType.TP_RANK: "tp",
    RankType.DP_RANK: "world",  # pipeline_parallel_degree is 1, so DP == WORLD
    RankType.RDP_RANK: "rdp",
}


def group_ranks(kind: str) -> tuple[int, ...]:
    """Global ranks of this rank's group of `kind` ("pp" is this rank alone), in group order."""
    if kind == "pp":
        return (rank(),)
    return state().topology.group(kind).ranks


def pp_rank() -> int:
    return 0


def pp_size() -> int:
    return 1


def mp_rank() -> int:
    return tp_rank()


def mp_size() -> int:
    return tp_size()


def _handle(group: Group) -> dist.ProcessGroup:
    if group.handle is None:
        raise RuntimeError(f"the {group.kind} group {list(group.ranks)} has no torch.distributed process group")
    return group.handle


def get_world_process_group() -> dist.ProcessGroup:
    return _handle(state().topology.group("world"))


def is_tracing() -> bool:
    """SMP v1: whether the tracing step runs. shardpar does not trace the model: always False."""
    return False


def get_dp_process_group() -> dist.ProcessGroup:
    return _handle(state().topology.group("world"))


def get_mp_process_group() -> dist.ProcessGroup:
    return _handle(state().topology.group("tp"))


def get_tp_process_group() -> dist.ProcessGroup:
    return _handle(state().topology.group("tp"))


def get_rdp_process_group() -> dist.ProcessGroup:
    return _handle(state().topology.group("rdp"))


def get_pp_process_group() -> dist.ProcessGroup:
    """A process group of this rank alone (the pipeline has one stage). Only this rank takes part in
    making it (use_local_synchronization), so a rank may ask for it at any time."""
    st = state()
    if size() == 1:
        return get_dp_process_group()
    if st.pp_group is None:
        st.pp_group = dist.new_group([rank()], use_local_synchronization=True)
        if st.pp_group is None:  # torch returns None only to non-members
            raise AssertionError("new_group returned no handle for its only member")
    return st.pp_group


WORLD = CommGroup.WORLD
DP_GROUP = CommGroup.DP_GROUP
PP_GROUP = CommGroup.PP_GROUP
TP_GROUP = CommGroup.TP_GROUP
MP_GROUP = CommGroup.MP_GROUP
RDP_GROUP = CommGroup.RDP_GROUP


# SMP v1's group queries that return global ranks (lists), not process groups.
def get_mp_group() -> list[int]:
    """The ranks that hold one model replica together (tp x pp = the TP group)."""
    return list(group_ranks("tp"))


def get_tp_group() -> list[int]:
    return list(group_ranks("tp"))


def get_pp_group() -> list[int]:
    return list(group_ranks("pp"))


def get_dp_group() -> list[int]:
    """The ranks that hold the same model partition: every rank (pipeline_parallel_degree is 1)."""
    return list(group_ranks("world"))


def get_rdp_group() -> list[int]:
    return list(group_ranks("rdp"))


def dp_barrier() -> None:
    """`smp.barrier(smp.DP_GROUP)`."""
    barrier(CommGroup.DP_GROUP)


def mp_barrier() -> None:
    """`smp.barrier(smp.MP_GROUP)`."""
    barrier(CommGroup.MP_GROUP)
