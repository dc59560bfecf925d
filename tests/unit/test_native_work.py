"""How the native engine waits ([Note: waits on the device] in shardpar/collectives/native.py): a CPU
collective is waited for on the host with the engine's timeout; a CUDA one only orders the current
stream after it (torch's NCCL `wait(timeout)` would block the host until the GPU finished)."""

from __future__ import annotations

import datetime
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from shardpar.collectives import Group, NativeEngine


class _RecordingWork:
    """A torch.distributed Work stand-in that records how it was waited for."""

    def __init__(self) -> None:
        self.waits: list[tuple[Any, ...]] = []

    def wait(self, *args: Any) -> bool:
        self.waits.append(args)
        return True

    def is_completed(self) -> bool:
        return True


GROUP = Group("test", (0, 1), handle=object())


def _waits(on: Any, timeout: float | None = None) -> list[tuple[Any, ...]]:
    inner = _RecordingWork()
    work = NativeEngine(timeout_s=7)._run(GROUP, lambda: inner, True, on=on)
    work.wait(timeout)
    work.wait()  # a second wait is a no-op
    return inner.waits


def test_cpu_collectives_are_waited_for_on_the_host_with_the_engine_timeout() -> None:
    assert _waits(torch.zeros(1)) == [(datetime.timedelta(seconds=7),)]


def test_cuda_collectives_only_order_the_stream() -> None:
    cuda_tensor = SimpleNamespace(is_cuda=True)  # the engine only asks the tensor where it lives
    assert _waits(cuda_tensor) == [()]


def test_an_explicit_timeout_blocks_the_host_on_either_device() -> None:
    assert _waits(SimpleNamespace(is_cuda=True), timeout=3) == [(datetime.timedelta(seconds=3),)]
    assert _waits(torch.zeros(1), timeout=3) == [(datetime.timedelta(seconds=3),)]


def test_avg_emulation_runs_after_the_wait() -> None:
    inner, order = _RecordingWork(), []
    work = NativeEngine()._run(GROUP, lambda: inner, True, lambda: order.append(len(inner.waits)), on=torch.zeros(1))
    work.wait()
    assert order == [1]


def test_a_deferred_gather_that_failed_fails_again_on_a_second_wait() -> None:
    """An engine without all_gather_after runs the chained gather inside wait(); a second wait after a
    failure must not report success (the unit would use a buffer that was never filled)."""
    from shardpar.collectives.base import _DeferredGather

    calls: list[float | None] = []

    def run(timeout: float | None) -> None:
        calls.append(timeout)
        raise RuntimeError("peer gone")

    work = _DeferredGather(run)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="peer gone"):
            work.wait()
    assert calls == [None] and not work.is_completed()  # ran once, still not done
