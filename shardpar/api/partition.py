"""SMP v1's manual pipeline partitioning, `smp.partition(index)` and `smp.set_partition(module, index)`.

`pipeline_parallel_degree` is 1 here (config.py), so there is one partition, 0, and every module is in
it: both accept index 0 and change nothing; any other index is an error naming the degree, since the
pipeline split it asks for cannot happen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


def _check_index(index: object, where: str) -> None:
    if not isinstance(index, int) or isinstance(index, bool):
        raise TypeError(f"{where}: the partition index must be an int, got {type(index).__name__} {index!r}")
    if index != 0:
        raise ValueError(
            f"{where}: partition {index} does not exist: pipeline_parallel_degree is 1 here, so the only "
            "partition is 0 (every module runs on every rank); remove the manual partitioning or use index 0"
        )


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Modules created inside go to partition `index` (SMP v1); here the one partition, 0."""
    _check_index(index, f"smp.partition({index!r})")
    yield


def set_partition(module: nn.Module, index: int) -> None:
    """Place `module` in partition `index` (SMP v1); here the one partition, 0."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"smp.set_partition needs an nn.Module, got {type(module).__name__}")
    _check_index(index, f"smp.set_partition({type(module).__name__}, {index!r})")
