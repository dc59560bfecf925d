"""Hierarchical AllGather for a sharding group that spans nodes (reference 003,
`sdp_hierarchical_allgather`).

Order: across nodes first, then inside each node. Each rank first exchanges its shard with the
peers at the same position on the other nodes (the only cross-node traffic: its own shard, once per
peer), then the node gathers those blocks locally. Gathering inside the node first would push every
node's whole block across the network from every local rank -- L times the cross-node bytes
(COLLECTIVES-GROUND.md measured 1.3-3.6x faster for this order).

    sharding group (0,4,8,12), 2 ranks a node -> node groups (0,4) (8,12), cross groups (0,8) (4,12)
    step 1 (cross):  rank 0 gets [s0 s2]      rank 4 gets [s1 s3]
    step 2 (node):   ranks 0,4 get [[s0 s2] [s1 s3]]   (local-major)
    permute:         [s0 s1 s2 s3]            (node-major = sharding-group order)

Results are bit-identical to the flat gather: only copies happen.
"""

from __future__ import annotations

import torch

from shardpar.collectives.base import Engine, Group, Work, check_gather_shapes


class HierarchicalGatherWork:
    """Step 1 runs asynchronously; `wait` finishes it, runs step 2 and puts blocks in place."""

    def __init__(
        self, engine: Engine, output: torch.Tensor, cross_out: torch.Tensor, cross_work: Work, node: Group, cross: Group
    ) -> None:
        self._engine, self._output, self._cross_out, self._cross_work = engine, output, cross_out, cross_work
        self._node, self._cross = node, cross
        self._done = False

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        self._cross_work.wait(timeout)
        num_local, num_nodes = self._node.size, self._cross.size
        staged = torch.empty_like(self._output)
        self._engine.all_gather(staged, self._cross_out, self._node)
        shard = self._output.numel() // (num_local * num_nodes)
        # staged is [local][node][shard]; the sharding group's order is [node][local][shard].
        self._output.view(num_nodes, num_local, shard).copy_(staged.view(num_local, num_nodes, shard).transpose(0, 1))
        self._done = True

    def is_completed(self) -> bool:
        return self._done


def hierarchical_all_gather(
    engine: Engine,
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    sharding: Group,
    node: Group,
    cross: Group,
    async_op: bool = False,
) -> Work:
    """AllGather over `sharding` as cross-node exchange then intra-node gather."""
    check_gather_shapes(output, input, sharding, "all_gather")
    if node.size * cross.size != sharding.size:
        raise AssertionError(f"node {node.ranks} x cross {cross.ranks} do not tile sharding {sharding.ranks}")
    cross_out = torch.empty(input.numel() * cross.size, dtype=input.dtype, device=input.device)
    work = HierarchicalGatherWork(
        engine, output, cross_out, engine.all_gather(cross_out, input, cross, async_op=True), node, cross
    )
    if not async_op:
        work.wait()
    return work
