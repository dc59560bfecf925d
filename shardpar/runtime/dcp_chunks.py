"""A ShardedTensor as torch.distributed.checkpoint (DCP) sees it: the rectangular chunks of the full
tensor this rank holds, so DCP's planner saves and loads our pieces in place, with no gathering.

DCP describes a rank's part of a tensor as chunks, each an N-d box (offsets, sizes) of the full tensor;
DTensor's Shard(0) gives one box of whole rows. Our piece is a contiguous range [start, start + length)
of the *flattened* parameter ([Note: sharded parameters] in sharded_tensor.py), which is in general no
box, but it is a union of few boxes, each contiguous in memory:

    shape [4, 5], range [3, 17):   row 0 cols 3-4 | rows 1-2 whole | row 3 cols 0-1
                                   box (0,3)+(1,2)   box (1,0)+(2,5)   box (3,0)+(1,2)

At each dim a range splits into a partial leading slab, whole slabs, and a partial trailing slab, and
the partial ones recurse into the next dim: at most 2 * ndim - 1 boxes, whatever the size. Each box is
a view of the local piece (`local[a:b].view(sizes)`), so DCP's load copies straight into the fp32 main
shard (or the optimizer's state), and its planner reads from an FSDP2 checkpoint exactly the overlap of
its Shard(0) row blocks with our boxes. Chunks of replicas (other sharding groups) are the same boxes;
DCP's save dedups them, so every element is written once.

A persistent parameter is whole on every rank, yet each rank of its group describes only its own block
of rows to DCP (`persistent_rows`: torch.chunk's split of dim 0 over the group, FSDP2's Shard(0)), as if
it were sharded. DCP's FileSystemReader deserializes a saved chunk whole for every read request that
overlaps it, so a rank describing the whole tensor read every saved block of it -- for an FSDP2
checkpoint of world W, W reads per tensor (and per Adam moment) where an FSDP2 rank makes one; for
GPT-NeoX at the default threshold that was 2.7x FSDP2's reads and most of a 2x slower load. A save
likewise writes each block once, from the rank that holds it. The price: after `dcp.load` a rank holds
only its rows, and `set_state_dict` gathers the rest over the group (checkpoint/dcp_persistent.py) --
FSDP2's recipe calls it anyway, and shardpar needs it after a DCP load regardless (it marks the main
values written, so the compute copies refresh).

A tensor-parallel split has no description here yet (its local tensor is itself a strided part of the
full one): `boxes` refuses it with what to use."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from shardpar.runtime.shard_layout import ShardLayout

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import MetadataIndex


@dataclass(frozen=True)
class Box:
    """One chunk: where it lies in the full tensor, and where in the flat local piece its elements are."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_start: int  # first element in the local piece (the piece is `layout.start`-based)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes (offsets, sizes), in flat order, whose union is flat elements [start, end) of `shape`."""
    if start >= end:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if start % inner:  # a partial leading slab: recurse into it
        row = start // inner
        stop = min(end, (row + 1) * inner)
        for off, size in flat_range_boxes(shape[1:], start - row * inner, stop - row * inner):
            out.append(((row, *off), (1, *size)))
        start = stop
    whole = (end - start) // inner
    if whole:
        out.append(((start // inner, *[0] * (len(shape) - 1)), (whole, *shape[1:])))
        start += whole * inner
    if start < end:  # a partial trailing slab
        row = start // inner
        for off, size in flat_range_boxes(shape[1:], 0, end - row * inner):
            out.append(((row, *off), (1, *size)))
    return out


def boxes(layout: ShardLayout) -> list[Box]:
    """This rank's chunks of a tensor of `layout` (none for an empty piece)."""
    if layout.tp is not None and layout.comm.tp.size > 1:
        raise ValueError(
            f"torch.distributed.checkpoint with the sharded state dict of {layout.fqn}, a tensor-parallel "
            "parameter: its pieces are not described for DCP yet. Pass StateDictOptions(full_state_dict=True) "
            "to get_state_dict / set_state_dict (full tensors), or use smp.save_checkpoint, which reshards TP"
        )
    shape = tuple(layout.shape)
    if not layout.sharded:
        first, end = persistent_rows(layout)
        if first >= end:
            return []
        if not shape:  # a 0-d tensor: one "row", on the group's first rank
            return [Box((), (), 0)]
        inner = math.prod(shape[1:])
        return [Box((first, *[0] * (len(shape) - 1)), (end - first, *shape[1:]), first * inner)]
    found, local = [], 0
    for off, size in flat_range_boxes(shape, layout.start, layout.start + layout.length):
        found.append(Box(off, size, local))
        local += math.prod(size)
    return found


def split_whole(layout: ShardLayout) -> bool:
    """Whether DCP sees a tensor of this layout as row blocks over a group although every rank holds it
    whole: a persistent, non-TP parameter (or its state) of a sharding group of more than one rank."""
    return not layout.sharded and layout.tp is None and layout.comm.sharding.size > 1


def row_block(rows: int, parts: int, index: int) -> tuple[int, int]:
    """Rows [first, end) of member `index` of `parts`: torch.chunk's split (blocks of ceil(rows / parts)
    rows, the last ones shorter or empty), the one FSDP2's Shard(0) uses, so at the same group size a
    rank reads exactly one saved block of an FSDP2 checkpoint."""
    size = -(-rows // parts)
    return min(index * size, rows), min((index + 1) * size, rows)


def persistent_rows(layout: ShardLayout) -> tuple[int, int]:
    """The rows of a persistent tensor this rank reads and writes through DCP (a 0-d tensor counts as one
    row); all of them when the tensor is not `split_whole`."""
    rows = layout.shape[0] if len(layout.shape) else 1
    if not split_whole(layout):
        return 0, rows
    if not torch.distributed.is_initialized():  # DCP on several ranks runs over torch.distributed
        size = layout.comm.sharding.size
        raise AssertionError(f"{layout.fqn}: a sharding group of {size} ranks without torch.distributed")
    group = layout.comm.sharding  # its ranks are global ranks, as torch.distributed numbers them
    return row_block(rows, group.size, group.rank_of(torch.distributed.get_rank()))


def box_view(local: torch.Tensor, box: Box) -> torch.Tensor:
    """The box's elements of the local piece, as a tensor of the box's sizes (a view: writes land in it)."""
    return local.reshape(-1)[box.local_start : box.local_start + box.numel].view(box.sizes)


def chunk_list(layout: ShardLayout) -> list[Any]:
    """DCP's `__create_chunk_list__`: ChunkStorageMetadata per box."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return [ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)) for b in boxes(layout)]


def write_items(fqn: str, local: torch.Tensor, layout: ShardLayout) -> list[Any]:
    """DCP's `__create_write_items__`: one SHARD item per box, indexed by its offsets."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    props = TensorProperties(dtype=local.dtype)
    return [
        WriteItem(
            index=MetadataIndex(fqn, torch.Size(b.offsets)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)),
                properties=props,
                size=torch.Size(layout.shape),
            ),
        )
        for b in boxes(layout)
    ]


def tensor_shard(local: torch.Tensor, layout: ShardLayout, index: MetadataIndex) -> torch.Tensor:
    """DCP's `__get_tensor_shard__`: the view of the box at `index.offset`."""
    want = tuple(index.offset) if index.offset is not None else tuple([0] * len(layout.shape))
    for b in boxes(layout):
        if b.offsets == want:
            return box_view(local, b)
    raise ValueError(f"{layout.describe()}: no chunk of this rank starts at {list(want)} (index {index})")
