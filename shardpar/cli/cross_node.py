"""Bytes a layout sends across nodes per training step, and how long the link takes for them (issue 28).

Pure arithmetic over the rank layout (topology.Plan) and the units' sizes, the same figures the
emulated-node benchmark reads from its links' counters (benchmarks/bench_nodes.py) and the test pins:

    per unit and step   gathers   forward + backward per micro-batch (the root unit: one, it stays
                                  gathered through the pass); one with sdp_node_secondary_shard
                        reduce    the gradient ReduceScatter: per micro-batch, or one at the boundary
                                  with sdp_defer_cross_node_reduce
    per step            replica   the main grads' AllReduce over the replication group (boundary)
                        persistent the persistent parameters' AllReduce over the rdp group (boundary)

How each collective crosses nodes: a hierarchical AllGather / two-hop ReduceScatter sends each rank's
shard (its row) straight to each peer on another node ([Note: hierarchical chaining], [Note: two-hop
ReduceScatter]); a flat collective is a ring over the group in rank order, each ring edge carrying
(n-1)/n of the data for a gather or a ReduceScatter and 2 (n-1)/n for an AllReduce, and only edges
between nodes count. Figures are per node: what node 0 sends to the others (every node sends the same
in the layouts shardpar builds). Payload bytes: the link adds its headers (~1 % at MTU 9000).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardpar.collectives.quantize import QBLOCK, padded
from shardpar.topology import Plan

if TYPE_CHECKING:  # only for its type: the estimate's arithmetic needs no model
    from shardpar.runtime.model import DistributedModel


@dataclass(frozen=True)
class Traffic:
    """Bytes node 0 sends to other nodes in one step, by cause."""

    gather: float = 0.0
    reduce: float = 0.0
    replica: float = 0.0
    persistent: float = 0.0

    @property
    def total(self) -> float:
        return self.gather + self.reduce + self.replica + self.persistent


@dataclass(frozen=True)
class Knobs:
    """The knobs that change what crosses nodes."""

    accum: int = 1  # backward passes per optimizer step
    compute_bytes: int = 4  # gathered dtype
    reduce_bytes: int = 4  # sdp_reduce_dtype
    hierarchical_allgather: bool = True
    hierarchical_reduce_scatter: bool = True
    defer_cross_node_reduce: bool = False
    node_secondary_shard: bool = False
    quantize_weights: bool = False  # int8 + a scale per block on the cross-node gather step
    quantize_gradients: bool = False  # likewise on the ReduceScatter's cross hop


def _node(plan: Plan, rank: int) -> int:
    return rank // plan.ranks_per_node


def _ring_bytes(plan: Plan, groups: Sequence[tuple[int, ...]], per_edge: float) -> float:
    """Bytes node 0 sends over ring edges to other nodes, summed over `groups` (each a ring in order)."""
    total = 0.0
    for ranks in groups:
        if len(ranks) < 2:
            continue
        for i, src in enumerate(ranks):
            dst = ranks[(i + 1) % len(ranks)]
            if _node(plan, src) == 0 and _node(plan, dst) != 0:
                total += per_edge
    return total


def _direct_bytes(plan: Plan, groups: Sequence[tuple[int, ...]], per_peer: float) -> float:
    """Bytes node 0 sends when every member sends `per_peer` straight to each member on another node."""
    total = 0.0
    for ranks in groups:
        for src in ranks:
            if _node(plan, src) == 0:
                total += per_peer * sum(1 for dst in ranks if _node(plan, dst) != 0)
    return total


def _quantized(numel: int) -> int:
    """Wire bytes of `numel` elements quantized ([Note: cross-node quantization]): int8 padded to whole
    blocks, and an fp32 scale per block."""
    return padded(numel) + padded(numel) // QBLOCK * 4


def traffic(
    plan: Plan,
    units: Sequence[int],
    knobs: Knobs,
    *,
    root_numel: int = 0,
    persistent_numel: int = 0,
    buckets: Sequence[int] | None = None,
) -> Traffic:
    """What node 0 sends across nodes per step. `units`: every sharded unit's padded element count
    except the root's, which is `root_numel` (gathered once per micro-batch); `buckets`: the reduce
    buckets' widths (shard elements; default one bucket) -- quantization pads each to whole blocks."""
    k, sdp = knobs.accum, plan.sdp
    sharded = sum(units) + root_numel
    secondary = knobs.node_secondary_shard and knobs.hierarchical_allgather
    reductions = 1 if knobs.defer_cross_node_reduce and knobs.hierarchical_reduce_scatter else k
    spans = plan.spans_nodes and sdp > 1
    if not spans:
        gather = reduce = 0.0
    else:
        gb, rb = knobs.compute_bytes, knobs.reduce_bytes
        # per-rank shard bytes of one gather of each unit, and how often each is gathered per step
        uses = [(root_numel, 1)] * bool(root_numel) + [(u, 2) for u in units]
        shard_bytes = [_quantized(u // sdp) if knobs.quantize_weights else u // sdp * gb for u, _ in uses]
        counts = [1 if secondary else k * n for _, n in uses]
        gathered_bytes = sum(b * c for b, c in zip(shard_bytes, counts, strict=True))
        gathered = sum(u * c for (u, _), c in zip(uses, counts, strict=True))  # elements, flat ring below
        if knobs.hierarchical_allgather:
            gather = _direct_bytes(plan, plan.sharding_cross_groups, gathered_bytes)
        else:
            gather = _ring_bytes(plan, plan.sharding_groups, gathered * (sdp - 1) / sdp * gb)
        widths = list(buckets) if buckets is not None else [sharded // sdp]
        row_bytes = sum(_quantized(w) for w in widths) if knobs.quantize_gradients else sum(widths) * rb
        if knobs.hierarchical_reduce_scatter:
            reduce = _direct_bytes(plan, plan.sharding_cross_groups, reductions * row_bytes)
        else:  # gloo's ReduceScatter is an AllReduce ([Note: ReduceScatter by exchange])
            reduce = _ring_bytes(plan, plan.sharding_groups, k * 2 * sharded * (sdp - 1) / sdp * rb)
    replicas = plan.num_replicas
    replica = _ring_bytes(
        plan, plan.replication_groups, 2 * (replicas - 1) / replicas * sharded / sdp * knobs.reduce_bytes
    )
    rdp = plan.rdp
    persistent = _ring_bytes(plan, plan.rdp_groups, 2 * (rdp - 1) / rdp * persistent_numel * knobs.reduce_bytes)
    return Traffic(gather, reduce, replica, persistent)


def model_traffic(model: DistributedModel, accum: int) -> Traffic:
    """`traffic` for a built DistributedModel (its units, topology and knobs)."""
    units = model.units
    cfg = model.shardpar_config
    root = [u.layout.padded_numel for u in units if u.module is model.module]
    rest = [u.layout.padded_numel for u in units if u.module is not model.module]
    policy = model.policy
    knobs = Knobs(
        accum=accum,
        compute_bytes=policy.compute.itemsize,
        reduce_bytes=policy.reduce.itemsize,
        hierarchical_allgather=cfg.sdp_hierarchical_allgather,
        hierarchical_reduce_scatter=cfg.sdp_hierarchical_reduce_scatter,
        defer_cross_node_reduce=cfg.sdp_defer_cross_node_reduce,
        node_secondary_shard=cfg.sdp_node_secondary_shard,
        quantize_weights=cfg.sdp_quantize_cross_node_weights,
        quantize_gradients=cfg.sdp_quantize_cross_node_gradients,
    )
    buckets = [plan.width for plan in model.reducer.plans]
    persistent = sum(p.numel() for _, p in model.persistent.named)
    layout = model.topology.plan
    return traffic(layout, rest, knobs, root_numel=sum(root), persistent_numel=persistent, buckets=buckets)


def link_seconds(nbytes: float, gbps: float) -> float:
    """Seconds a link of `gbps` Gbit/s needs for `nbytes` (one direction)."""
    return nbytes * 8 / (gbps * 1e9)


def nodes_spanned(plan: Plan) -> int:
    """Nodes one sharding group has members on (1: the group fits in a node)."""
    return len({_node(plan, r) for r in plan.sharding_groups[0]})


def extra_state_bytes(plan: Plan, sharded_numel: int, knobs: Knobs) -> dict[str, int]:
    """Per-rank memory the cross-node knobs add ([Note: secondary shard], [Note: cross hop at the
    boundary]): N x the sharded parameters in the compute dtype, N x the sharded gradients in fp32."""
    nodes = nodes_spanned(plan)
    if nodes == 1 or plan.sdp == 1:
        return {}
    shard = sharded_numel // plan.sdp
    out = {}
    if knobs.node_secondary_shard and knobs.hierarchical_allgather and plan.sdp > nodes:
        out["secondary shards (sdp_node_secondary_shard)"] = nodes * shard * knobs.compute_bytes
    if knobs.defer_cross_node_reduce and knobs.hierarchical_reduce_scatter and knobs.accum > 1 and plan.sdp > nodes:
        out["deferred node sums (sdp_defer_cross_node_reduce)"] = nodes * shard * 4
    if knobs.quantize_gradients and knobs.hierarchical_reduce_scatter and plan.sdp > nodes:
        out["error feedback (sdp_quantize_cross_node_gradients)"] = nodes * shard * 4
    return out


def report(plan: Plan, units: Sequence[int], knobs: Knobs, gbps: float, *, root_numel: int = 0) -> str:
    """`shardpar estimate --link-gbps`: cross-node bytes per step and link time for this layout, beside
    sdp = the node's ranks (MiCS's own choice), and which moves less."""
    lines = []
    rows = [("this layout", plan)]
    node_sdp = max(1, plan.ranks_per_node // plan.tp)
    if plan.sdp != node_sdp and plan.rdp % node_sdp == 0:
        rows.append(("one node", Plan(plan.world, plan.tp, node_sdp, plan.ranks_per_node)))
    results = []
    for label, p in rows:
        t = traffic(p, units, knobs, root_numel=root_numel)
        results.append(t.total)
        lines.append(
            f"  {label + f', sdp {p.sdp}':28s} across nodes per step {t.total / 2**20:10.1f} MiB "
            f"(gathers {t.gather / 2**20:.1f}, gradient reduce {t.reduce / 2**20:.1f}, replicas "
            f"{t.replica / 2**20:.1f}) = {link_seconds(t.total, gbps):.3f} s at {gbps:g} Gbit/s per node"
        )
    if len(results) == 2:
        better = "sdp = one node moves less" if results[1] < results[0] else "this layout moves no more"
        lines.append(f"  -> {better} across nodes (node-local sdp keeps N x the model states per rank)")
    return "\n".join(lines)


def print_estimate(args: Any, shape: Any, setup: Any, world: int) -> None:
    """`shardpar estimate --link-gbps`: the cross-node part, before the memory estimate."""
    from shardpar.topology import plan

    rpn = setup.ranks_per_node or min(world, 8)
    layout = plan(world, setup.tp, setup.sdp, rpn)
    knobs = knobs_of(setup)
    units, root = list(shape.unit_numels[1:]), shape.unit_numels[0]
    print(f"across nodes ({world // rpn} nodes of {rpn} ranks, accumulation {setup.accum}):")
    print(report(layout, units, knobs, args.link_gbps, root_numel=root))
    for name, nbytes in extra_state_bytes(layout, sum(shape.unit_numels), knobs).items():
        print(f"  + {name}: {nbytes / 2**30:.2f} GiB per rank (in the estimate below)")


def knobs_of(setup: Any) -> Knobs:
    """The cross-node knobs of an estimate's Setup."""
    return Knobs(
        accum=setup.accum,
        compute_bytes=2 if setup.precision != "fp32" else 4,
        node_secondary_shard=setup.node_secondary_shard,
        defer_cross_node_reduce=setup.defer_cross_node_reduce,
        quantize_weights=setup.quantize_cross_node,
        quantize_gradients=setup.quantize_cross_node,
    )
