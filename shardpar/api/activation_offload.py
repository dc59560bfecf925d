"""Activation offloading (SMP v1's `offload_activations` and `activation_loading_horizon`): the inputs an
activation checkpoint keeps from forward leave the device after the checkpointed call and come back in
backward, ahead of the recomputation that needs them.

[Note: activation offloading]
A checkpoint keeps only its inputs from forward (checkpoint_group.py); offloading moves those to host:

    forward    right after checkpointed call k ran, its kept inputs that need a gradient (the
               activations: a layer's hidden states) are copied to host and the checkpoint drops its
               device reference; the checkpoint joins the queue of offloaded checkpoints. Inputs that need
               no gradient (attention masks, position ids, rotary tables) stay: every layer gets the same
               ones, so they are alive elsewhere and moving them would free nothing.
    backward   the first unpack of checkpoint f (its recomputation) starts reloading f and the
               `activation_loading_horizon` checkpoints queued before it -- the next ones backward will
               reach -- and waits for f's copy only:

                   queue (forward order)   c0  c1  c2  c3  c4  c5        horizon 2
                   recompute c5:           reload c5 (needed now), c3, c4
                   recompute c4:           reload c2
                   recompute c3:           reload c1  ...

The horizon counts checkpoints: under strategy 'group_N' a group of N layers is one.

On CUDA the copies run on a side stream (one per device), into pinned host memory, so they overlap
compute: the side stream waits for the stream that produced the activation, `record_stream` keeps the
caching allocator from reusing the device memory before the copy has read it, and the recomputation's
stream waits on the reload's event. On CPU there is no device to leave: the same path copies into a
separate host buffer and back, synchronously, so its bookkeeping and its results are tested without a GPU.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class OffloadedFrame(Protocol):
    """A checkpoint whose kept inputs were offloaded (checkpoint_group.GroupFrame)."""

    @property
    def label(self) -> Any: ...  # what events name it by: its first module

    def reload(self) -> int: ...  # start reloading every offloaded input; how many started now


@dataclass
class OffloadStats:
    """What the offloader moved. `events` (None = not recorded) lists ("offload" | "reload" |
    "recompute", the checkpoint's first module) in the order they happened; tests set it to []."""

    num_offloaded: int = 0  # tensors copied off the device
    num_reloaded: int = 0  # tensors copied back
    bytes_offloaded: int = 0
    events: list[tuple[str, Any]] | None = field(default=None, repr=False)

    def record(self, kind: str, label: Any) -> None:
        if self.events is not None:
            self.events.append((kind, label))


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill its span exactly (any order of dimensions): then a copy can keep its
    strides, and the recomputation sees the same layout as forward did."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _empty_like(t: torch.Tensor, device: torch.device, *, pin: bool) -> torch.Tensor:
    if _dense(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device, pin_memory=pin)
    return torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)


class OffloadedTensor:
    """One kept input, on host until reloaded. `wait()` is the device tensor, ready on the caller's stream."""

    __slots__ = ("_device", "_event", "_host", "_loaded", "_stream")

    def __init__(self, t: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        self._device = t.device
        self._stream = stream
        self._loaded: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        host = _empty_like(t, torch.device("cpu"), pin=stream is not None)
        if stream is None:
            host.copy_(t)
        else:
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t is computed before it is read
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # the allocator must not reuse t's memory before the copy read it
        self._host: torch.Tensor | None = host

    @property
    def nbytes(self) -> int:
        host = self._host if self._host is not None else self._loaded
        if host is None:
            raise AssertionError("an offloaded tensor holds neither its host copy nor its reload")
        return host.numel() * host.element_size()

    @property
    def reloading(self) -> bool:
        return self._loaded is not None

    def start_reload(self) -> bool:
        """Queue the copy back to the device; False when it was queued already."""
        if self._loaded is not None:
            return False
        host = self._host
        if host is None:
            raise AssertionError("an offloaded tensor lost its host copy before it was reloaded")
        if self._stream is None:
            loaded = _empty_like(host, self._device, pin=False)
            loaded.copy_(host)
            self._host = None
        else:
            # Allocated and filled on the side stream (after the offload copy, which ran there first);
            # the host copy is kept until wait() so the pinned block outlives the copy reading it.
            with torch.cuda.stream(self._stream):
                loaded = _empty_like(host, self._device, pin=False)
                loaded.copy_(host, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(self._stream)
        self._loaded = loaded
        return True

    def wait(self) -> torch.Tensor:
        """The reloaded tensor (reloading now if nobody started it), usable on the current stream."""
        self.start_reload()
        loaded = self._loaded
        if loaded is None:
            raise AssertionError("start_reload left no tensor")
        if self._event is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_event(self._event)
            loaded.record_stream(current)  # allocated on the side stream, used (and freed) on this one
            self._host = None
        return loaded


class ActivationOffloader:
    """The queue of offloaded checkpoints and the side streams ([Note: activation offloading])."""

    def __init__(self, horizon: int) -> None:
        if not isinstance(horizon, int) or isinstance(horizon, bool) or horizon < 1:
            raise ValueError(f"activation_loading_horizon={horizon!r} must be an integer >= 1")
        self.horizon = horizon
        self.stats = OffloadStats()
        # Offloaded checkpoints in forward order whose recomputation has not started. Weak: a forward
        # whose backward never comes frees its checkpoints (and their host copies) with its graph.
        self._queue: list[weakref.ref[OffloadedFrame]] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        # Forward runs on the main thread, backward on autograd's device threads (CUDA).
        self._lock = threading.Lock()

    @property
    def queued(self) -> int:
        """Offloaded checkpoints alive whose recomputation has not started."""
        with self._lock:
            return sum(r() is not None for r in self._queue)

    def offload(self, t: torch.Tensor) -> OffloadedTensor:
        """Copy `t` off its device (the caller drops its own reference)."""
        handle = OffloadedTensor(t, self._stream(t.device))
        self.stats.num_offloaded += 1
        self.stats.bytes_offloaded += handle.nbytes
        return handle

    def offloaded(self, frame: OffloadedFrame, label: Any) -> None:
        """`frame` offloaded the inputs of its call of `label`: it joins the queue (once)."""
        with self._lock:
            self.stats.record("offload", label)
            self._queue = [r for r in self._queue if r() is not None]
            if not any(r() is frame for r in self._queue[-1:]):
                self._queue.append(weakref.ref(frame))

    def before_recompute(self, frame: OffloadedFrame) -> None:
        """`frame` is about to be recomputed: reload it and the `horizon` checkpoints backward reaches next."""
        with self._lock:
            live = [(r, f) for r in self._queue if (f := r()) is not None]
            at = next((i for i in range(len(live) - 1, -1, -1) if live[i][1] is frame), None)
            ahead = [] if at is None else [f for _, f in reversed(live[max(0, at - self.horizon) : at])]
            self._queue = [r for i, (r, _) in enumerate(live) if i != at]
            for f in (frame, *ahead):
                started = f.reload()
                if started:
                    self.stats.num_reloaded += started
                    self.stats.record("reload", f.label)
            self.stats.record("recompute", frame.label)

    def _stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None  # CPU (and devices without streams here): synchronous copies to a separate buffer
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream
