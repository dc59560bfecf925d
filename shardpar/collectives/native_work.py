"""The native engine's work handles (native.py): a torch.distributed Work bounded by the engine's
timeout and explained on failure, several Works waited for as one, and steps chained on a CUDA side
stream."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import torch

from shardpar.collectives.failures import CollectiveError

# How a wait that failed becomes the error to raise: (error, seconds waited, seconds allowed).
Explain = Callable[[BaseException, float, float], BaseException]


class NativeWork:
    """Wraps a torch.distributed Work; finishes an AVG that the backend could only do as SUM.

    [Note: waits on the device]
    A CPU collective (gloo) is done when `wait` returns, and `wait` bounds it with the engine's
    timeout. A CUDA one (NCCL) runs on NCCL's own stream: waiting means making the current stream wait
    on its end event, so the host goes on queueing kernels while the collective and the compute before
    it overlap on the device -- the side stream and event of FSDP's overlap. torch's
    `Work.wait(timeout)` on NCCL instead blocks the host until the collective finished on the GPU,
    which would serialise every prefetch with the host, so a device-side work waits without one; its
    deadline is the process group's timeout, enforced by NCCL's watchdog, which turns a dead peer into
    an error. shardpar passes `collective_timeout_s` to the init_process_group and new_group calls it
    makes; where the caller started the default group itself, groups that span the whole world reuse
    it and keep the caller's timeout (torch's default: 10 min for NCCL). An explicit `timeout` still
    blocks the host, as torch does.
    """

    def __init__(
        self,
        work: Any,
        *,
        timeout_s: float,
        finish: Any = None,
        on_device: bool = False,
        explain: Explain | None = None,
    ) -> None:
        self._work = work
        self._timeout_s = timeout_s
        self._finish = finish
        self._on_device = on_device
        self._explain = explain
        self._done = False

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        seconds, start = self._timeout_s if timeout is None else timeout, time.monotonic()
        try:
            if self._on_device and timeout is None:
                self._work.wait()  # stream-ordered, see [Note: waits on the device]
            else:
                self._work.wait(datetime.timedelta(seconds=seconds))
        except RuntimeError as error:  # gloo / NCCL: "Connection closed by peer", timeouts, ...
            if self._explain is None or isinstance(error, CollectiveError):
                raise
            raise self._explain(error, time.monotonic() - start, seconds) from error
        if self._finish is not None:
            self._finish()
        self._done = True

    def is_completed(self) -> bool:
        return self._done or bool(self._work.is_completed())


class AllOf:
    """Works waited for together: one batch of point-to-point calls, or the chunks of one gather."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        for work in self._works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


class EventWork:
    """Chained steps on a CUDA side stream: waiting makes the current stream wait on their end."""

    def __init__(self, event: Any, timeout_s: float, device: torch.device) -> None:
        self._event, self._timeout_s, self._device = event, timeout_s, device

    def wait(self, timeout: float | None = None) -> None:
        if timeout is None:
            # the output's device's current stream, not the current device's ([Note: waits on the device])
            torch.cuda.current_stream(self._device).wait_event(self._event)
            return
        deadline = time.monotonic() + timeout
        while not self._event.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"chained all_gather did not finish on the device within {timeout:g} s")
            time.sleep(0.001)

    def is_completed(self) -> bool:
        return bool(self._event.query())
