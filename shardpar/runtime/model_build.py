"""The wrap's construction steps that need no model yet (DistributedModel.__init__, model.py): which
parameters persist, whether the sharding group's collectives run in two hops, the units with their
shards, and which units a unit borrows parameters from."""

from __future__ import annotations

import torch
from torch import nn

from shardpar.collectives import Engine, Group
from shardpar.config import Config
from shardpar.precision import DtypePolicy
from shardpar.runtime.frozen import FrozenShard
from shardpar.runtime.frozen_quant import QUANTIZED
from shardpar.runtime.initial_values import InitialValues
from shardpar.runtime.replica_shard import NoReplicas, ReplicaComm
from shardpar.runtime.schedule import LiveCounter
from shardpar.runtime.two_hop import TwoHopReduce
from shardpar.runtime.unit import Unit
from shardpar.runtime.unit_comm import UnitComm
from shardpar.sharding.layout import flat_layout
from shardpar.sharding.plan import UnitPlan
from shardpar.topology import Topology

Registered = dict[int, list[nn.Parameter]]


def split_persistent(plans: list[UnitPlan], config: Config) -> tuple[list[tuple[str, nn.Parameter]], dict[int, int]]:
    """Take the persistent parameters out of the unit plans: (name, param) pairs, and the index of
    the unit each came from (its modules hold it, runtime/user_params.py).

    Only trained parameters persist. A persistent parameter costs an fp32 main copy, a compute copy
    and an fp32 main grad on every rank, which is what a trained one needs to skip its gathers; a
    frozen one needs none of them, so however small it is sharded with its unit's frozen shard in its
    own dtype (runtime/frozen.py) and gathered with it. At 168M under LoRA the frozen tensors under
    the default threshold were 7.2M elements, 69 MiB a rank kept whole (issue 33).

    Except under sdp_frozen_base_mode 'int8' / 'nf4': the frozen shard is quantized, and QLoRA
    (bitsandbytes) quantizes the linear weights only; biases and layer norms stay in full precision,
    so there the small frozen 1-D tensors persist as before. A small frozen matrix (GPT-NeoX 168m's
    768 x 768 `dense` weights are under the default threshold) is a linear weight QLoRA quantizes:
    it goes into the quantized shard (kept whole it would cost 10 bytes a value, not 1.06)."""
    threshold = config.sdp_param_persistence_threshold
    quantized = config.sdp_frozen_base_mode in QUANTIZED
    persistent: list[tuple[str, nn.Parameter]] = []
    unit_of: dict[int, int] = {}
    for i, up in enumerate(plans):
        keep = [
            (n, p) for n, p in up.params if p.numel() < threshold and (p.requires_grad or (quantized and p.dim() < 2))
        ]
        kept = {id(p) for _, p in keep}
        persistent.extend(keep)
        unit_of.update((id(p), i) for _, p in keep)
        up.params = [(n, p) for n, p in up.params if id(p) not in kept]
    return persistent, unit_of


def in_two_hops(topology: Topology, knob: bool, node: Group, cross: Group) -> bool:
    """Whether a collective over the sharding group runs in a node hop and a cross hop: its knob is on
    and the group has members on several nodes, more than one on each (with one a node, the flat
    collective is the cross hop already)."""
    return knob and topology.plan.spans_nodes and node.size > 1 and cross.size > 1


def two_hop_reduce(
    config: Config, topology: Topology, engine: Engine, policy: DtypePolicy, device: torch.device
) -> TwoHopReduce | None:
    """The two-hop ReduceScatter when the sharding group spans nodes ([Note: two-hop ReduceScatter])."""
    node, cross = topology.groups["sharding_node_reduce"], topology.groups["sharding_cross"]
    if not in_two_hops(topology, config.sdp_hierarchical_reduce_scatter, node, cross):
        return None
    return TwoHopReduce(
        engine,
        node,
        cross,
        policy.reduce,
        device,
        defer=config.sdp_defer_cross_node_reduce,
        quantize=config.sdp_quantize_cross_node_gradients,
    )


def build_units(
    plans: list[UnitPlan],
    values: InitialValues,
    *,
    config: Config,
    topology: Topology,
    engine: Engine,
    policy: DtypePolicy,
    device: torch.device,
    replicas: ReplicaComm | NoReplicas,
    live: LiveCounter,
) -> list[Unit]:
    """One Unit a plan, each holding its shards (of rank 0's values) and its replica strategy."""
    node, cross = topology.groups["sharding_node"], topology.groups["sharding_cross"]
    hierarchical = in_two_hops(topology, config.sdp_hierarchical_allgather, node, cross)
    comm = UnitComm(
        engine=engine,
        sharding=topology.sharding,
        replication=topology.replication,
        shard_index=topology.coords.sdp_rank,
        node=node if hierarchical else None,
        cross=cross if hierarchical else None,
        on_live_change=live,
        secondary=config.sdp_node_secondary_shard,
        quantize=config.sdp_quantize_cross_node_weights,
    )
    units: list[Unit] = []
    # the model's frozen shards warn once of a dequantized read (frozen_exact.py), on rank 0: the
    # other ranks count as told already
    warned: set[str] = set() if topology.rank == 0 else {"int8", "nf4"}
    for up in plans:
        # Units without sharded parameters are kept (they communicate nothing): their hooks still
        # hold the parameters they borrow (smp.register_parameter) and mark the start of backward.
        align = replicas.align  # each shard splits over the replicas
        trained = [(n, p) for n, p in up.params if p.requires_grad]
        layout = flat_layout([(n, tuple(p.shape)) for n, p in trained], comm.sharding.size, align=align)
        # Frozen at wrap time: their own shard, in their dtype ([Note: frozen shards], frozen.py)
        frozen = [(n, p) for n, p in up.params if not p.requires_grad]
        name = up.name or "<root>"
        frozen_shard = None
        if frozen:
            frozen_layout = flat_layout([(n, tuple(p.shape)) for n, p in frozen], comm.sharding.size)
            frozen_shard = FrozenShard(
                name,
                [p for _, p in frozen],
                frozen_layout,
                comm,
                compute_dtype=policy.compute,
                device=device,
                mode=config.sdp_frozen_base_mode,
                warned=warned,
            )
        unit = Unit(
            len(units),
            name,
            up.module,
            [p for _, p in trained],
            layout,
            comm,
            policy=policy,
            device=device,
            frozen=frozen_shard,
        )
        values.take_real(p for _, p in up.params)
        unit.take_shards_from_params(values, every_param=values.collective)
        unit.replicas = replicas.strategy(unit)  # now: one unit's fp32 shard at a time beside the pieces
        units.append(unit)
    return units


def link_dependencies(
    units: list[Unit], plans: list[UnitPlan], registered: Registered, unit_of_param: dict[int, Unit]
) -> None:
    """A unit that uses parameters of another (borrowed, or registered with smp.register_parameter)
    depends on that unit: it is gathered with it."""
    by_module = {id(u.module): u for u in units}
    for up in plans:
        user = by_module.get(id(up.module))
        borrowed = list(up.borrowed) + [p for m in up.module.modules() for p in registered.get(id(m), [])]
        for p in borrowed:
            owner = unit_of_param.get(id(p))
            if owner is None or user is None or owner is user or owner in user.deps:
                continue
            user.deps.append(owner)
