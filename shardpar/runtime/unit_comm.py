"""What a unit needs to communicate (UnitComm): the engine, its groups, and how it AllGathers --
flat, or hierarchically when the sharding group spans nodes ([Note: hierarchical chaining])."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardpar.collectives import Engine, Group, Work
from shardpar.collectives.hierarchical import hierarchical_all_gather, scratch_numel


@dataclass(frozen=True)
class UnitComm:
    """What a unit needs to communicate: the engine, its groups, and how to AllGather."""

    engine: Engine
    sharding: Group
    replication: Group
    shard_index: int
    # Set when the sharding group spans nodes and sdp_hierarchical_allgather is on.
    node: Group | None = None
    cross: Group | None = None
    on_live_change: Callable[[Any, int], None] | None = None  # (unit, +/- elements)
    # sdp_node_secondary_shard: units keep their cross-node blocks for the step ([Note: secondary shard]).
    secondary: bool = False
    # sdp_quantize_cross_node_weights: int8 on the cross step ([Note: cross-node quantization]).
    quantize: bool = False

    @property
    def keeps_secondary(self) -> bool:
        return self.secondary and self.node is not None and self.cross is not None

    def secondary_numel(self, shard_numel: int) -> int:
        """Elements of a unit's secondary shard: its shard from every node."""
        return 0 if self.cross is None else shard_numel * self.cross.size

    def gather(
        self,
        output: torch.Tensor,
        shard: torch.Tensor,
        *,
        async_op: bool,
        unit: Any = None,
        blocks: torch.Tensor | None = None,
        blocks_ready: bool = False,
    ) -> Work:
        """AllGather `shard` into `output`; a hierarchical gather reports its scratch buffers for `unit`
        through `on_live_change` while it holds them ([Note: hierarchical chaining]). `blocks` and
        `blocks_ready`: the unit's secondary shard ([Note: secondary shard])."""
        if self.node is not None and self.cross is not None:
            on_live, on_scratch = self.on_live_change, None
            if on_live is not None and unit is not None:
                on_scratch = lambda delta: on_live(unit, delta)  # noqa: E731
            return hierarchical_all_gather(
                self.engine,
                output,
                shard,
                sharding=self.sharding,
                node=self.node,
                cross=self.cross,
                async_op=async_op,
                on_scratch=on_scratch,
                blocks=blocks,
                blocks_ready=blocks_ready,
                quantize=self.quantize,
            )
        return self.engine.all_gather(output, shard, self.sharding, async_op=async_op)

    def gather_scratch(self, numel: int) -> int:
        """Elements `gather` holds besides an output of `numel` while it runs (the live cap counts them)."""
        if self.node is None or self.cross is None:
            return 0
        return scratch_numel(numel, self.node.size, own_blocks=self.keeps_secondary)
