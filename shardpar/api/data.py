"""prescaled_batch (reference 003): the TP group reads ONE combined batch, so the dataset is divided
into rdp_size parts (world / tensor_parallel_degree), not world parts. Every rank of a TP group gets
the same slice; each TP layer then sees identical inputs on all its ranks.

    world 8, tp 2: rdp ranks 0 0 1 1 2 2 3 3 (ranks 0..7)  ->  global batch of 8 rows, 2 per TP group
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree
from torch.utils.data import Dataset, DistributedSampler

T = TypeVar("T")


def _rdp(rdp_rank: int | None, rdp_size: int | None) -> tuple[int, int]:
    if rdp_rank is None or rdp_size is None:
        import shardpar.api.context as smp  # the facade's state, only when the caller did not pass it

        rdp_rank = smp.rdp_rank() if rdp_rank is None else rdp_rank
        rdp_size = smp.rdp_size() if rdp_size is None else rdp_size
    if not 0 <= rdp_rank < rdp_size:
        raise ValueError(f"rdp_rank={rdp_rank} must be in [0, rdp_size={rdp_size})")
    return rdp_rank, rdp_size


def rdp_slice(batch: T, *, rdp_rank: int | None = None, rdp_size: int | None = None) -> T:
    """This rank's rows of a global batch (tensors in any dict/list/tuple nesting, cut along dim 0
    into `rdp_size` equal contiguous parts; part `rdp_rank`). Defaults: smp.rdp_rank(), smp.rdp_size()."""
    rank, size = _rdp(rdp_rank, rdp_size)

    def cut(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.dim() == 0 or x.shape[0] % size:
            raise ValueError(
                f"prescaled batch: a tensor of shape {tuple(x.shape)} cannot be cut into rdp_size={size} equal "
                f"parts along dim 0; make the global batch a multiple of {size}"
            )
        n = x.shape[0] // size
        return x[rank * n : (rank + 1) * n]

    out: T = pytree.tree_map(cut, batch)
    return out


def rdp_sampler(
    dataset: Dataset[Any],
    *,
    rdp_rank: int | None = None,
    rdp_size: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
) -> DistributedSampler[Any]:
    """A DistributedSampler over rdp_size replicas: the ranks of one TP group draw the same samples."""
    rank, size = _rdp(rdp_rank, rdp_size)
    return DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
