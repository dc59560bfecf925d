"""SMP v1's DeepSpeed attributes, as views of what shardpar already holds.

SMP v1 built sharded data parallelism on DeepSpeed ZeRO-3, and AWS's templates read its attributes when
`sharded_data_parallel_degree > 1` (sdp_utils.py: `build_param_id_to_offset`, `log_param_norms`):

    p.ds_tensor                                 this rank's partition of parameter p (1-D), `.ds_numel` long
    p.ds_param_shard_group / optimizer.ds_param_shard_group
                                                the process group the partitions of a parameter split over
    optimizer.fp32_partitioned_groups_flat[i]   the fp32 main partitions of param group i end to end, in
                                                the group's order, each `p.ds_tensor.ds_numel` long

Here a parameter's partition is its ShardedTensor's local piece ([Note: sharded parameters]), over the
sharding group (the rdp group with shard_optimizer_state). A persistent parameter is whole on every rank
of that group; its "partition" is this rank's equal part of it, so that the partitions of every parameter
are disjoint over the group and a sum of squares AllReduced over it counts each element once -- what
`log_param_norms` relies on, as it did with DeepSpeed.

    persistent p (numel 10) over 4 ranks:   | r0: 0..3 | r1: 3..6 | r2: 6..9 | r3: 9..10 |
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardpar.collectives import Group
from shardpar.runtime.shard_layout import ShardLayout


def part_range(numel: int, size: int, index: int) -> tuple[int, int]:
    """[start, end) of position `index`'s equal part of `numel` elements split over `size` ranks."""
    per = -(-numel // size)
    return min(numel, index * per), min(numel, (index + 1) * per)


def _my_index(group: Group) -> int:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return group.rank_of(rank) if group.size > 1 else 0


def partition(local: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """This rank's DeepSpeed-style partition of a parameter (or of a tensor laid out like it) whose local
    piece is `local`: the piece itself when sharded, this rank's equal part of it when persistent."""
    flat = local.reshape(-1)
    if layout.sharded:
        return flat
    start, end = part_range(flat.numel(), layout.comm.sharding.size, _my_index(layout.comm.sharding))
    return flat[start:end]


def ds_tensor(local: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """`p.ds_tensor`: the partition, a view, carrying DeepSpeed's `ds_numel` (its length). The attribute is
    set on the fresh view handed out, never on the parameter."""
    view = partition(local, layout).view(-1)
    view.ds_numel = view.numel()  # type: ignore[attr-defined]
    return view


def process_group(group: Group) -> Any:
    """The torch.distributed process group of `group`, for `torch.distributed.all_reduce(..., group=)`."""
    if group.handle is None:
        raise ValueError(
            f"the {group.kind} group {list(group.ranks)} has no torch.distributed process group on this rank "
            "(a world of one, or an engine without one); with one rank there is nothing to reduce: skip the "
            "all_reduce when smp.size() == 1"
        )
    return group.handle


class FlatPartitions:
    """`optimizer.fp32_partitioned_groups_flat[i]`: one param group's fp32 main partitions end to end.

    DeepSpeed kept them in one flat tensor; here each lies in its own unit's main shard, so this is the
    list of live views with the flat offsets. `narrow(0, offset, length)` inside one partition -- what
    the templates do, with offsets summed from `p.ds_tensor.ds_numel` -- returns a view of the main
    values (reads see every step, writes reach the optimizer); a range across partitions is refused, since
    it could only be a stale copy. `torch.cat(flat.partitions)` is a copy of all of it."""

    def __init__(self, partitions: Sequence[torch.Tensor], names: Sequence[str]) -> None:
        self.partitions = list(partitions)
        self._names = list(names)
        self._starts = [0]
        for part in self.partitions:
            self._starts.append(self._starts[-1] + part.numel())

    def numel(self) -> int:
        return self._starts[-1]

    def __len__(self) -> int:
        return self.numel()

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.numel()])

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim != 0:
            raise ValueError(f"fp32_partitioned_groups_flat[i].narrow(dim={dim}, ...): it is 1-D; narrow dim 0")
        for i, part in enumerate(self.partitions):
            begin, end = self._starts[i], self._starts[i + 1]
            if begin <= start and start + length <= end:
                return part.narrow(0, start - begin, length)
        raise ValueError(
            f"fp32_partitioned_groups_flat[i].narrow(0, {start}, {length}) spans more than one parameter's partition "
            f"(offsets {self._starts}, parameters {self._names}); shardpar keeps each partition in its own unit's "
            "main shard, so only a range inside one is a live view: narrow by each parameter's p.ds_tensor.ds_numel, "
            "or use torch.cat(flat.partitions) for a copy"
        )
