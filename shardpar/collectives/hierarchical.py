"""Hierarchical AllGather for a sharding group that spans nodes (reference 003,
`sdp_hierarchical_allgather`): the one algorithm, used by the model's units (through whatever engine
they run on) and by the smddp engine's own spanning gathers (its shm transport as the node step).

Order: across nodes first, then inside each node. Each rank first exchanges its shard with the
peers at the same position on the other nodes (the only cross-node traffic: its own shard, once per
peer), then the node gathers those blocks locally. Gathering inside the node first would push every
node's whole block across the network from every local rank -- L times the cross-node bytes
(docs/design.md section 10: measured 1.3-3.6x faster for this order).

    sharding group (0,4,8,12), 2 ranks a node -> node groups (0,4) (8,12), cross groups (0,8) (4,12)
    step 1 (cross):  rank 0 gets [s0 s2]      rank 4 gets [s1 s3]          -> blocks  (unit / L)
    step 2 (node):   ranks 0,4 get [[s0 s2] [s1 s3]]   (local-major)        -> staged  (a whole unit)
    permute:         [s0 s1 s2 s3]            (node-major = sharding-group order) -> output

Results are bit-identical to the flat gather: only copies happen.

[Note: secondary shard]
The blocks of step 1 are exactly what ZeRO++ calls a secondary shard (hpZ) and FSDP2 a
`reshard_after_forward=int` shard: this rank's slice of the unit when the unit is sharded over the node
only -- N shards, 1/L of the unit. With `sdp_node_secondary_shard` a unit keeps them (in the compute
dtype) after its first gather of a step, and every later gather of that step -- backward's re-gather,
the next micro-batches' forward and backward -- runs step 2 alone, inside the node. They are dropped
when the unit's values change (the optimizer step, a load, a write through a user parameter: the unit's
`refresh_compute`). Cost: N x the unit's shard per rank, from the first forward of a step to its
optimizer step; saved: (2 x micro-batches - 1) of the step's cross-node gathers.

# [Note: hierarchical chaining]
# Step 2 and the permute are chained on step 1 when the gather is issued (`all_gather_after`: the
# smddp worker, the native engine's chain thread, or a side stream on CUDA), so an async gather --
# a prefetch -- completes while the caller computes; `wait` only waits. Step 2 runs on another thread
# than the caller's collectives, so its group ("sharding_node") has a process group of its own, shared
# with no other kind (topology.py): two threads on one group would issue in a different order on
# different ranks. Both scratch buffers (blocks and staged, `scratch_numel`) are reported through
# `on_scratch` when allocated and released in `wait`. On the host paths that is after the last use;
# on CUDA `wait` only queues the wait, so the side stream may still be using them for a moment: the
# cap counts what the host holds, and the caching allocator keeps the blocks until their stream is done.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardpar.collectives import quantize
from shardpar.collectives.base import CompletedWork, Engine, Group, Work, all_gather_after, check_gather_shapes

# (staged, blocks, after, then): gather `blocks` inside the node into `staged` once `after` has
# completed, then call `then`; returns at once, in issue order with the engine's other calls.
NodeStep = Callable[[torch.Tensor, torch.Tensor, Work, Callable[[], None]], Work]


@dataclass(frozen=True)
class HierarchicalSteps:
    """How an engine runs the two steps. `cross(blocks, input)` starts the cross-node exchange."""

    cross: Callable[[torch.Tensor, torch.Tensor], Work]
    node: NodeStep


def engine_steps(engine: Engine, node: Group, cross: Group) -> HierarchicalSteps:
    """Both steps as ordinary engine calls over the two groups (each counted by a CountingEngine)."""
    return HierarchicalSteps(
        cross=lambda blocks, input: engine.all_gather(blocks, input, cross, async_op=True),
        node=lambda staged, blocks, after, then: all_gather_after(engine, staged, blocks, node, after=after, then=then),
    )


def scratch_numel(numel: int, num_local: int, *, own_blocks: bool = False) -> int:
    """Elements a hierarchical gather of `numel` output elements holds besides its output: the
    cross-node blocks (numel / num_local; not with `own_blocks`, a secondary shard the caller keeps)
    and the node-local staging buffer (numel). Zero when the node step has one rank (the blocks are the
    output)."""
    return 0 if num_local == 1 else numel + (0 if own_blocks else numel // num_local)


class HierarchicalGatherWork:
    """The chained steps; `wait` waits for the last one and releases the scratch count."""

    def __init__(self, last: Work, on_scratch: Callable[[int], None] | None, scratch: int) -> None:
        self._last, self._on_scratch, self._scratch = last, on_scratch, scratch

    def wait(self, timeout: float | None = None) -> None:
        try:
            self._last.wait(timeout)
        finally:
            self._release()

    def is_completed(self) -> bool:
        return self._last.is_completed()

    def _release(self) -> None:
        if self._scratch and self._on_scratch is not None:
            self._on_scratch(-self._scratch)
        self._scratch = 0


def hierarchical_all_gather(
    engine: Engine,
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    sharding: Group,
    node: Group,
    cross: Group,
    async_op: bool = False,
    steps: HierarchicalSteps | None = None,
    on_scratch: Callable[[int], None] | None = None,
    blocks: torch.Tensor | None = None,
    blocks_ready: bool = False,
    quantize: bool = False,
) -> Work:
    """AllGather over `sharding` as cross-node exchange then intra-node gather ([Note: hierarchical
    chaining]). `steps` defaults to plain engine calls over `node` and `cross`; `on_scratch(+/-n)`
    hears of the scratch elements held. `blocks`: the caller's buffer for the cross-node blocks (its
    node-local secondary shard, [Note: secondary shard]), kept after the gather; with `blocks_ready` it
    already holds them, and only the node step runs -- nothing crosses nodes. `quantize`: the cross step
    sends int8 blocks ([Note: cross-node quantization], quantize.py)."""
    check_gather_shapes(output, input, sharding, "all_gather")
    if node.size * cross.size != sharding.size:
        raise AssertionError(f"node {node.ranks} x cross {cross.ranks} do not tile sharding {sharding.ranks}")
    steps = steps or engine_steps(engine, node, cross)
    if node.size == 1:  # one rank a node: the cross-node blocks are the sharding group's order
        work = steps.cross(output, input)
    else:
        num_local, num_nodes, shard = node.size, cross.size, input.numel()
        scratch = output.numel() + (0 if blocks is not None else shard * num_nodes)
        if blocks is None:
            blocks = torch.empty(shard * num_nodes, dtype=input.dtype, device=input.device)
        staged = torch.empty_like(output)
        if on_scratch is not None:
            on_scratch(scratch)

        def permute() -> None:
            # staged is [local][node][shard]; the sharding group's order is [node][local][shard].
            output.view(num_nodes, num_local, shard).copy_(staged.view(num_local, num_nodes, shard).transpose(0, 1))

        crossed: Work = CompletedWork()
        if quantize and not blocks_ready:
            crossed = _quantized_cross(engine, blocks, input, cross)
        elif not blocks_ready:
            crossed = steps.cross(blocks, input)
        last = steps.node(staged, blocks, crossed, permute)
        work = HierarchicalGatherWork(last, on_scratch, scratch)
    if not async_op:
        work.wait()
    return work


def _quantized_cross(engine: Engine, blocks: torch.Tensor, input: torch.Tensor, cross: Group) -> Work:
    """Step 1 with int8 on the wire: every rank's shard quantized, gathered, and dequantized -- this
    rank's own too, so every rank computes with the same values ([Note: cross-node quantization])."""
    shard, num_nodes = input.numel(), cross.size
    q, scales = quantize.quantize(input.view(1, -1))
    q_all = torch.empty(num_nodes * q.numel(), dtype=torch.int8, device=input.device)
    scales_all = torch.empty(num_nodes * scales.numel(), dtype=torch.float32, device=input.device)
    works = [
        engine.all_gather(q_all, q.view(-1), cross, async_op=True),
        engine.all_gather(scales_all, scales.view(-1), cross, async_op=True),
    ]

    def finish() -> None:
        values = quantize.dequantize(q_all.view(num_nodes, -1), scales_all.view(num_nodes, -1), shard, blocks.dtype)
        blocks.view(num_nodes, shard).copy_(values)

    return quantize.FinishingWork(works, finish)
