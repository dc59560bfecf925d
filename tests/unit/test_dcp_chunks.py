"""runtime/dcp_chunks.py: a contiguous range of a flattened tensor as the boxes DCP describes chunks by --
every range of every small shape, against indexing the full tensor."""

from __future__ import annotations

import math

import pytest
import torch

from shardpar.runtime.dcp_chunks import flat_range_boxes, row_block


@pytest.mark.parametrize("shape", [(7,), (4, 5), (3, 4, 5), (2, 3, 2, 3)])
def test_boxes_cover_exactly_the_range_in_flat_order(shape: tuple[int, ...]) -> None:
    n = math.prod(shape)
    index = torch.arange(n).view(shape)
    for start in range(n):
        for end in range(start, n + 1):
            boxes = flat_range_boxes(shape, start, end)
            got: list[int] = []
            for offsets, sizes in boxes:
                box = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
                got += box.reshape(-1).tolist()  # a box is contiguous in the flat order, so a view of the piece
            assert got == list(range(start, end)), (shape, start, end, boxes)
            assert len(boxes) <= 2 * len(shape) - 1


def test_example_from_the_docstring() -> None:
    assert flat_range_boxes((4, 5), 3, 17) == [((0, 3), (1, 2)), ((1, 0), (2, 5)), ((3, 0), (1, 2))]


def test_persistent_row_blocks_are_torch_chunks() -> None:
    """A persistent tensor's row blocks over a group are torch.chunk's (FSDP2's Shard(0)), empty ones
    included, and cover the rows once."""
    for rows in range(0, 12):
        for parts in range(1, 6):
            chunks = [c.tolist() for c in torch.arange(rows).chunk(parts)] if rows else []
            got = [list(range(*row_block(rows, parts, i))) for i in range(parts)]
            assert [g for g in got if g] == chunks, (rows, parts, got)
            assert [r for g in got for r in g] == list(range(rows))
