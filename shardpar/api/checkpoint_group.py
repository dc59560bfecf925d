"""One activation checkpoint over several consecutive children of a list whose loop is the parent's
(`for layer in self.layers: h = layer(h, ...)`): the `group_N` / `contiguous` strategies.

[Note: group checkpoints]
torch.utils.checkpoint wraps one function call; a group of list children is several calls with the
parent's code between them, which must stay outside the checkpoint (the recomputation replays the
children only, so tensors the parent saves between them would be matched against the wrong ones).
So a `GroupFrame` is the non-reentrant checkpoint's mechanism (torch/utils/checkpoint.py, the saved
tensor hooks of `_checkpoint_hook` / `_recomputation_hook`) spread over the calls of one group:

    forward    child k runs under pack hooks that keep a slot, not the tensor; its call is recorded:
               the inputs it got, except those that are child k-1's outputs (a *link*: position j of
               k-1's output), its RNG and autocast state.
    backward   the first unpack of any slot replays the recorded calls in order -- each child's own
               `__call__`, so unit hooks gather it again -- with child k's linked inputs taken from
               child k-1's replayed outputs; what each child saves is stored for its slots, each freed
               at its one unpack.

Only the first child's inputs (and inputs that are not the previous child's outputs, such as an
attention mask shared by every layer) are kept from forward: that is the group's memory. Every child
runs twice per step, as under one torch checkpoint. The calls of a group must come in order within one
forward; a call out of order (a skipped child, a slice of the list) starts a new frame there, which is
exact and only keeps more.

With `offload_activations` the kept inputs leave the device after each call's forward and come back
ahead of the recomputation (activation_offload.py, [Note: activation offloading]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import uuid
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states

from shardpar.api.activation_offload import ActivationOffloader, OffloadedTensor


class _Slot:
    """What the graph keeps in place of a saved tensor: per backward (graph task), the key under which
    the recomputed tensor waits, None once unpacked."""

    __slots__ = ("__weakref__", "keys")

    def __init__(self) -> None:
        self.keys: dict[int, _Key | None] = {}


class _Key:
    __slots__ = ("__weakref__",)


@dataclass(frozen=True)
class _Held:
    """An input kept from forward. A tensor is kept detached (same storage and version counter): its
    graph may lead back into this group, whose saved tensors' hooks hold the frame -- a cycle through
    C++ autograd nodes that Python's collector cannot free when no backward comes."""

    value: Any  # an OffloadedTensor once offloaded
    version: int | None  # a tensor's version counter when the call got it
    requires_grad: bool = False


@dataclass(frozen=True)
class _Link:
    index: int  # position among the previous call's output tensors


@dataclass
class _RecordedCall:
    module: nn.Module
    run: Callable[..., Any]
    spec: pytree.TreeSpec
    inputs: list[_Held | _Link]
    cpu_rng: torch.Tensor | None
    device_rng: tuple[list[int], list[torch.Tensor]]
    autocast: list[tuple[str, dict[str, Any]]]
    slots: list[weakref.ref[_Slot]] = field(default_factory=list)
    saved_meta: list[tuple[torch.Size, torch.dtype, torch.device]] = field(default_factory=list)
    outputs: list[tuple[weakref.ref[torch.Tensor], int]] = field(default_factory=list)  # until the next call


def _autocast_state(device_type: str) -> list[tuple[str, dict[str, Any]]]:
    return [
        (dt, {"enabled": torch.is_autocast_enabled(dt), "dtype": torch.get_autocast_dtype(dt)})
        for dt in dict.fromkeys((device_type, "cpu"))
        if torch.amp.is_autocast_available(dt)
    ]


def _device_type(leaves: list[Any]) -> str:
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta"):
            return t.device.type
    return "cuda"  # torch.utils.checkpoint's default; nothing is read from it without such a tensor


def _tensor_leaves(obj: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def is_kv_cache(value: object) -> bool:
    """A Hugging Face key/value cache (transformers.cache_utils.Cache and its subclasses)."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers.") for c in type(value).__mro__)


def without_kv_caches(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of a recomputation: every Hugging Face key/value cache replaced by None
    ([Note: caches in a recomputation] in activation_checkpointing.py)."""
    return (
        tuple(None if is_kv_cache(a) else a for a in args),
        {k: None if is_kv_cache(v) else v for k, v in kwargs.items()},
    )


class GroupFrame:
    """The checkpoint of one forward's calls of one group ([Note: group checkpoints])."""

    def __init__(self, *, preserve_rng_state: bool, offloader: ActivationOffloader | None = None) -> None:
        self.preserve_rng_state = preserve_rng_state
        self.offloader = offloader
        self.calls: list[_RecordedCall] = []
        self.last_member = -1
        # Per graph task, recomputed tensors by key; an entry goes when its slot's key does (unpacked,
        # or the slot freed with a graph that never ran backward).
        self.recomputed: defaultdict[int, weakref.WeakKeyDictionary[_Key, torch.Tensor]] = defaultdict(
            weakref.WeakKeyDictionary
        )
        self.recomputed_for: set[int] = set()

    # ---- forward --------------------------------------------------------------------------------

    def run(self, member: int, module: nn.Module, run: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        call = self._record(module, run, leaves, spec)
        with torch.autograd.graph.saved_tensors_hooks(self._pack_hook(call), self._unpack):
            out = run(*args, **kwargs)
        call.outputs = [(weakref.ref(t), t._version) for t in _tensor_leaves(out)]
        self.last_member = member
        # Not inside a backward: a checkpoint met in another one's recomputation is recomputed at once.
        if self.offloader is not None and torch._C._current_graph_task_id() == -1:
            self._offload(call)
        return out

    def _offload(self, call: _RecordedCall) -> None:
        """Replace the call's kept activations by host copies ([Note: activation offloading]). An input
        already modified in place stays as it is: the recomputation then raises, as it would without."""
        offloader = self.offloader
        if offloader is None:
            raise AssertionError("_offload without an offloader")
        done: dict[tuple[Any, ...], OffloadedTensor] = {}  # one copy of an input passed twice
        for i, item in enumerate(call.inputs):
            if not isinstance(item, _Held) or not item.requires_grad:
                continue
            t = item.value
            if not isinstance(t, torch.Tensor) or t._version != item.version:
                continue
            key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device)
            handle = done.get(key) or offloader.offload(t)
            done[key] = handle
            call.inputs[i] = dataclasses.replace(item, value=handle)
        if done:
            offloader.offloaded(self, call.module)

    @property
    def label(self) -> nn.Module:
        return self.calls[0].module

    def reload(self) -> int:
        """Start reloading every offloaded input; the number of copies started now."""
        handles = {id(i.value): i.value for c in self.calls for i in c.inputs if isinstance(i, _Held)}
        return sum(h.start_reload() for h in handles.values() if isinstance(h, OffloadedTensor))

    def _record(self, module: nn.Module, run: Callable[..., Any], leaves: list[Any], spec: Any) -> _RecordedCall:
        previous = self.calls[-1].outputs if self.calls else []
        inputs: list[_Held | _Link] = []
        for leaf in leaves:
            link = None
            if isinstance(leaf, torch.Tensor):
                link = next((j for j, (ref, v) in enumerate(previous) if ref() is leaf and leaf._version == v), None)
            if link is not None:
                inputs.append(_Link(link))
            elif isinstance(leaf, torch.Tensor):
                inputs.append(_Held(leaf.detach(), leaf._version, leaf.requires_grad))
            else:
                inputs.append(_Held(leaf, None))
        if self.calls:
            self.calls[-1].outputs = []  # only the next call links to them
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        call = _RecordedCall(
            module=module,
            run=run,
            spec=spec,
            inputs=inputs,
            cpu_rng=torch.get_rng_state() if self.preserve_rng_state else None,
            device_rng=get_device_states(*tensors) if self.preserve_rng_state else ([], []),
            autocast=_autocast_state(_device_type(tensors)),
        )
        self.calls.append(call)
        return call

    def _pack_hook(self, call: _RecordedCall) -> Callable[[torch.Tensor], _Slot]:
        def pack(t: torch.Tensor) -> _Slot:
            slot = _Slot()
            call.slots.append(weakref.ref(slot))
            call.saved_meta.append((t.shape, t.dtype, t.device))
            return slot

        return pack

    # ---- backward -------------------------------------------------------------------------------

    def _unpack(self, slot: _Slot) -> torch.Tensor:
        gid = torch._C._current_graph_task_id()
        if gid == -1:
            gid = uuid.uuid4().int  # an unpack outside backward: recompute for it alone
        if gid not in self.recomputed_for:
            if self.offloader is not None:
                self.offloader.before_recompute(self)
            self._recompute(gid)
            self.recomputed_for.add(gid)
        key = slot.keys.get(gid)
        if key is None:
            raise RuntimeError(
                "a tensor saved under a group activation checkpoint was unpacked twice in one backward; "
                "read ctx.saved_tensors once in a custom autograd.Function's backward"
            )
        slot.keys[gid] = None
        return self.recomputed[gid].pop(key)

    def _recompute(self, gid: int) -> None:
        devices = sorted({d for c in self.calls for d in c.device_rng[0]})
        device_type = _device_type([t.value for c in self.calls for t in c.inputs if isinstance(t, _Held)])
        previous: list[torch.Tensor] = []
        with (
            torch.random.fork_rng(devices=devices, enabled=self.preserve_rng_state, device_type=device_type),
            torch.enable_grad(),
        ):
            for call in self.calls:
                args, kwargs = pytree.tree_unflatten([self._input(call, i, previous) for i in call.inputs], call.spec)
                args, kwargs = without_kv_caches(args, kwargs)  # [Note: caches in a recomputation]
                if call.cpu_rng is not None:
                    torch.set_rng_state(call.cpu_rng)
                    if call.device_rng[0]:
                        set_device_states(*call.device_rng, device_type=device_type)
                with self._recording(call, gid), _autocast(call.autocast):
                    out = call.run(*args, **kwargs)
                previous = _tensor_leaves(out)

    @staticmethod
    def _input(call: _RecordedCall, item: _Held | _Link, previous: list[torch.Tensor]) -> Any:
        if isinstance(item, _Link):
            if item.index >= len(previous):
                raise RuntimeError(
                    f"activation checkpoint recomputation: {type(call.module).__name__}'s input came from "
                    f"output {item.index} of the previous layer, which returned only {len(previous)} tensors "
                    "when recomputed; the layers' forward must be deterministic"
                )
            return previous[item.index]
        value = item.value
        if isinstance(value, OffloadedTensor):  # its version was checked when it was offloaded
            return value.wait().detach().requires_grad_(item.requires_grad)
        if item.version is None:
            return value
        if value._version != item.version:
            raise RuntimeError(
                f"an input of {type(call.module).__name__} under a group activation checkpoint was modified "
                "in place after the call (its version counter moved from "
                f"{item.version} to {value._version}); the recomputation would see other values. "
                "Clone it before modifying it, or checkpoint with strategy='each'"
            )
        # A leaf again where the forward's input required grad: the module saves what it saved then.
        return value.detach().requires_grad_(item.requires_grad)

    @contextlib.contextmanager
    def _recording(self, call: _RecordedCall, gid: int) -> Iterator[None]:
        count = 0
        name = type(call.module).__name__

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal count
            t = t.detach() if t.requires_grad else t
            if count >= len(call.slots):
                raise RuntimeError(
                    f"activation checkpoint recomputation of {name} saved more tensors ({count + 1}) than its "
                    f"forward did ({len(call.slots)}); its forward must do the same work when recomputed"
                )
            meta = (t.shape, t.dtype, t.device)
            if meta != call.saved_meta[count]:
                raise RuntimeError(
                    f"activation checkpoint recomputation of {name}: saved tensor {count} is {meta} now, "
                    f"{call.saved_meta[count]} in forward; its forward must do the same work when recomputed"
                )
            slot = call.slots[count]()
            count += 1
            if slot is not None:  # else its graph node is gone already
                key = slot.keys[gid] = _Key()
                self.recomputed[gid][key] = t
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        if count != len(call.slots):
            raise RuntimeError(
                f"activation checkpoint recomputation of {name} saved {count} tensors, its forward "
                f"{len(call.slots)}; its forward must do the same work when recomputed"
            )


@contextlib.contextmanager
def _autocast(state: list[tuple[str, dict[str, Any]]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device_type, kwargs in state:
            stack.enter_context(torch.autocast(device_type, **kwargs))
        yield


class GroupCheckpoint:
    """The `__call__` of every member of one group: consecutive calls in one forward share a frame."""

    def __init__(
        self,
        members: list[nn.Module],
        *,
        preserve_rng_state: bool,
        base_call: Callable[[nn.Module], Any],
        find_offloader: Callable[[], ActivationOffloader | None],
    ) -> None:
        self._size = len(members)
        self._preserve_rng_state = preserve_rng_state
        self._base_call = base_call
        self._find_offloader = find_offloader  # read at each forward: smp.init may come after checkpointing
        # The frame of the forward under way, while its next member may still come. Weak: the graph
        # keeps a frame alive (through its slots' unpack hook), nothing else should.
        self._open: weakref.ref[GroupFrame] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_open": None}  # a copied model starts without a forward under way

    def member_call(self, member: int) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any]:
        """The `__call__` of the group's member number `member`."""
        return functools.partial(self._call, member)

    def _call(self, member: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        run = self._base_call(module)
        if not torch.is_grad_enabled():
            return run(*args, **kwargs)
        frame = self._open() if self._open is not None else None
        if frame is None or frame.last_member != member - 1:
            frame = GroupFrame(preserve_rng_state=self._preserve_rng_state, offloader=self._find_offloader())
        out = frame.run(member, module, run, args, kwargs)
        self._open = weakref.ref(frame) if member + 1 < self._size else None
        return out
