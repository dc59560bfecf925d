"""Rank layout: pure arithmetic (`plan`) first, torch.distributed process groups (`Topology`) second.

The layout follows reference 003, "Sharded data parallelism with tensor parallelism", Example 2:
tensor-parallel groups are formed first from consecutive ranks; the ranks with the same TP rank form
a reduced-data-parallel (rdp) group; each rdp group is cut into contiguous sharding groups of size
sdp; the ranks at the same position in every sharding group form a replication group.

    world 32, tp 4, sdp 4:
    TP groups:          (0,1,2,3) (4,5,6,7) ... (28,29,30,31)
    rdp group of tp 0:  (0,4,8,12,16,20,24,28)
    sharding groups:    (0,4,8,12) (16,20,24,28)
    replication groups: (0,16) (4,20) (8,24) (12,28)

Node-local groups are runs of `ranks_per_node` consecutive ranks. For the hierarchical AllGather and
ReduceScatter each sharding group is further split into its members on one node (`sharding_node_groups`)
and the members with the same position on their node (`sharding_cross_groups`) -- when every node holds
the same number of the group's ranks; otherwise those are empty and the flat collectives are used. The
ReduceScatter's node hop has a group kind of its own (`sharding_node_reduce`, the same ranks): it runs on
the caller's thread, the AllGather's node hop on the engine's chain thread ([Note: hierarchical chaining]).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from shardpar.collectives.base import Group

Ranks = tuple[int, ...]

GROUP_KINDS = (
    "world",
    "tp",
    "rdp",
    "sharding",
    "replication",
    "node",
    "sharding_node",
    "sharding_node_reduce",
    "sharding_cross",
)


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits in the layout."""

    rank: int
    tp_rank: int
    rdp_rank: int
    sdp_rank: int
    replica: int
    node: int
    local_rank: int


@dataclass(frozen=True)
class Plan:
    """Every group of a (world, tp, sdp, ranks_per_node) layout, as tuples of global ranks."""

    world: int
    tp: int
    sdp: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        for name in ("world", "tp", "sdp", "ranks_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"plan: {name}={getattr(self, name)} must be >= 1")
        if self.world % self.tp:
            raise ValueError(f"plan: tensor_parallel_degree={self.tp} must divide world {self.world}")
        if self.rdp % self.sdp:
            raise ValueError(
                f"plan: sharded_data_parallel_degree={self.sdp} must divide the rdp degree {self.rdp} "
                f"(world {self.world} / tp {self.tp})"
            )
        if self.world % self.ranks_per_node:
            divisors = [d for d in range(1, self.world + 1) if self.world % d == 0]
            raise ValueError(
                f"ranks_per_node={self.ranks_per_node} (the ranks_per_node knob, else LOCAL_WORLD_SIZE) must "
                f"divide the world size {self.world}; use one of {divisors}"
            )

    @property
    def rdp(self) -> int:
        return self.world // self.tp

    @property
    def num_replicas(self) -> int:
        return self.rdp // self.sdp

    @property
    def num_nodes(self) -> int:
        return self.world // self.ranks_per_node

    # ---- per-rank arithmetic (O(1), no group lists) ------------------------------------------

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside world {self.world}")
        tp_rank, rdp_rank = rank % self.tp, rank // self.tp
        return RankCoords(
            rank=rank,
            tp_rank=tp_rank,
            rdp_rank=rdp_rank,
            sdp_rank=rdp_rank % self.sdp,
            replica=rdp_rank // self.sdp,
            node=rank // self.ranks_per_node,
            local_rank=rank % self.ranks_per_node,
        )

    def groups_of(self, rank: int) -> dict[str, Ranks]:
        """The group of each kind that `rank` belongs to."""
        c = self.coords(rank)
        tp, sdp = self.tp, self.sdp
        first_of_sharding = c.replica * sdp * tp + c.tp_rank
        sharding = tuple(first_of_sharding + i * tp for i in range(sdp))
        node_start = c.node * self.ranks_per_node
        node_group = tuple(range(node_start, node_start + self.ranks_per_node))
        split = _split_by_node(sharding, self.ranks_per_node)
        return {
            "world": tuple(range(self.world)),
            "tp": tuple(range(c.rdp_rank * tp, (c.rdp_rank + 1) * tp)),
            "rdp": tuple(range(c.tp_rank, self.world, tp)),
            "sharding": sharding,
            "replication": tuple(c.tp_rank + (r * sdp + c.sdp_rank) * tp for r in range(self.num_replicas)),
            "node": node_group,
            "sharding_node": next((g for g in split[0] if rank in g), ()) if split else (),
            "sharding_node_reduce": next((g for g in split[0] if rank in g), ()) if split else (),
            "sharding_cross": next((g for g in split[1] if rank in g), ()) if split else (),
        }

    # ---- all groups of a kind, in a deterministic order --------------------------------------

    @cached_property
    def tp_groups(self) -> tuple[Ranks, ...]:
        return tuple(tuple(range(g * self.tp, (g + 1) * self.tp)) for g in range(self.rdp))

    @cached_property
    def rdp_groups(self) -> tuple[Ranks, ...]:
        return tuple(tuple(range(t, self.world, self.tp)) for t in range(self.tp))

    @cached_property
    def sharding_groups(self) -> tuple[Ranks, ...]:
        return tuple(
            rdp_group[r * self.sdp : (r + 1) * self.sdp]
            for rdp_group in self.rdp_groups
            for r in range(self.num_replicas)
        )

    @cached_property
    def replication_groups(self) -> tuple[Ranks, ...]:
        return tuple(
            tuple(rdp_group[r * self.sdp + i] for r in range(self.num_replicas))
            for rdp_group in self.rdp_groups
            for i in range(self.sdp)
        )

    @cached_property
    def node_groups(self) -> tuple[Ranks, ...]:
        rpn = self.ranks_per_node
        return tuple(tuple(range(n * rpn, (n + 1) * rpn)) for n in range(self.num_nodes))

    @cached_property
    def sharding_node_groups(self) -> tuple[Ranks, ...]:
        splits = [_split_by_node(g, self.ranks_per_node) for g in self.sharding_groups]
        return tuple(sub for s in splits if s for sub in s[0])

    @cached_property
    def sharding_node_reduce_groups(self) -> tuple[Ranks, ...]:
        # the same ranks as sharding_node, for the ReduceScatter's node hop on the caller's thread
        return self.sharding_node_groups

    @cached_property
    def sharding_cross_groups(self) -> tuple[Ranks, ...]:
        splits = [_split_by_node(g, self.ranks_per_node) for g in self.sharding_groups]
        return tuple(sub for s in splits if s for sub in s[1])

    def all_groups(self, kind: str) -> tuple[Ranks, ...]:
        if kind == "world":
            return (tuple(range(self.world)),)
        if kind == "rdp":
            return self.rdp_groups
        groups: tuple[Ranks, ...] = getattr(self, f"{kind}_groups")
        return groups

    @property
    def spans_nodes(self) -> bool:
        """Whether a sharding group has members on more than one node."""
        return self.num_nodes > 1 and len({r // self.ranks_per_node for r in self.sharding_groups[0]}) > 1


def _split_by_node(group: Ranks, ranks_per_node: int) -> tuple[tuple[Ranks, ...], tuple[Ranks, ...]] | None:
    """(per-node subgroups, cross-node subgroups) of `group`, or None when nodes hold unequal counts."""
    by_node: dict[int, list[int]] = {}
    for r in group:
        by_node.setdefault(r // ranks_per_node, []).append(r)
    counts = {len(v) for v in by_node.values()}
    if len(counts) != 1:
        return None
    per_node = tuple(tuple(v) for v in by_node.values())
    cross = tuple(tuple(node[i] for node in per_node) for i in range(len(per_node[0])))
    return per_node, cross


def plan(world: int, tp: int = 1, sdp: int = 1, ranks_per_node: int | None = None) -> Plan:
    """Pure rank arithmetic; `ranks_per_node` None means the whole world is one node."""
    return Plan(world=world, tp=tp, sdp=sdp, ranks_per_node=ranks_per_node or world)


class Topology:
    """The process groups of a plan, for this rank. Creating one is a collective over the world."""

    def __init__(self, plan_: Plan, rank: int, *, timeout_s: float = 300.0, backend: str | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise AssertionError("Topology needs the default process group; call smp.init() first")
        if dist.get_world_size() != plan_.world:
            raise AssertionError(f"plan is for world {plan_.world}, process group has {dist.get_world_size()}")
        self.plan = plan_
        self.rank = rank
        self.coords = plan_.coords(rank)
        timeout = datetime.timedelta(seconds=timeout_s)
        mine = plan_.groups_of(rank)
        # One process group per distinct rank set: with tp=1 and one replica the rdp, sharding and
        # world groups are the same ranks, and a second communicator would only cost connections.
        self._by_ranks: dict[Ranks, Any] = {}
        self.groups: dict[str, Group] = {}
        for kind in GROUP_KINDS:
            self.groups[kind] = self._make(kind, mine[kind], timeout, backend)

    def _make(self, kind: str, my_ranks: Ranks, timeout: datetime.timedelta, backend: str | None) -> Group:
        import torch.distributed as dist

        if kind == "world":
            return Group(kind, my_ranks, dist.group.WORLD)
        handle: Any = None
        # The node step of a hierarchical AllGather runs on the engine's chain thread, while the main
        # thread may run other collectives: a process group shared with another kind (the "node" group
        # has the same ranks when tp is 1) would see the two threads' calls in a different order on
        # different ranks. So "sharding_node" never shares one ([Note: hierarchical chaining]).
        private = kind == "sharding_node"
        # torch.distributed.new_group must be called by every rank, for every group, in one order.
        for ranks in self.plan.all_groups(kind):
            if private:
                pg: Any = dist.new_group(list(ranks), timeout=timeout, backend=backend)
            elif len(ranks) == self.plan.world:
                pg = dist.group.WORLD
            elif ranks in self._by_ranks:
                pg = self._by_ranks[ranks]
            else:
                pg = dist.new_group(list(ranks), timeout=timeout, backend=backend)
            if not private:
                self._by_ranks[ranks] = pg
            if ranks == my_ranks:
                handle = pg
        return Group(kind, my_ranks, handle)

    def group(self, kind: str) -> Group:
        if kind not in self.groups:
            raise ValueError(f"unknown group kind {kind!r}; one of {GROUP_KINDS}")
        return self.groups[kind]

    @property
    def sharding(self) -> Group:
        return self.groups["sharding"]

    @property
    def replication(self) -> Group:
        return self.groups["replication"]

    @property
    def rdp(self) -> Group:
        return self.groups["rdp"]

    @property
    def tp(self) -> Group:
        return self.groups["tp"]
