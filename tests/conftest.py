"""Shared fixtures: the multi-rank pool cache, and skipping of GPU tests without CUDA."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings

import shardpar as smp
from tests.harness import PoolCache

# Hypothesis fails an example that runs over 200 ms by default: a wall-clock budget, which a loaded
# machine (2 cores shared by several runs) breaks. No example here is judged by its time.
settings.register_profile("shardpar", deadline=None)
settings.load_profile("shardpar")


@pytest.fixture(scope="session")
def ranks() -> Iterator[PoolCache]:
    """`ranks.run(world, fn, *args)` runs `fn` on `world` gloo ranks; pools live for the session."""
    cache = PoolCache()
    yield cache
    cache.close()


@pytest.fixture(scope="session")
def compat_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """compat/smdistributed-shardpar pip-installed once for the session (tests/smdistributed_compat.py):
    the unit checks and the 2-rank run only read it, so one `pip install` serves both."""
    from tests import smdistributed_compat

    return smdistributed_compat.install(tmp_path_factory.mktemp("compat"))


@contextlib.contextmanager
def init_world_of_one(monkeypatch: pytest.MonkeyPatch, **knobs: Any) -> Iterator[None]:
    """smp.init() in this test's process as a world of one (no launcher variables), shut down after."""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    smp.init({"sdp_param_persistence_threshold": 10, **knobs})
    try:
        yield
    finally:
        smp.shutdown()


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with init_world_of_one(monkeypatch):
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
