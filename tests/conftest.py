"""Shared fixtures: the multi-rank pool cache, and skipping of GPU tests without CUDA."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.harness import PoolCache


@pytest.fixture(scope="session")
def ranks() -> Iterator[PoolCache]:
    """`ranks.run(world, fn, *args)` runs `fn` on `world` gloo ranks; pools live for the session."""
    cache = PoolCache()
    yield cache
    cache.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
