"""Memory measurement for tests, from the tensors themselves rather than from what the code says it keeps.

* `LiveBytes`: a dispatch mode that tracks the bytes of every real storage that ops create while it is
  active, freed by refcount; `peak` is the high-water mark. For "at most one full parameter at a time".
* `LiveTensors`: every storage reachable from a live `torch.Tensor` (found by `gc.get_objects()`, plus
  the `.grad` of leaves, which may exist only on the C++ side), minus those alive when the snapshot was
  taken. For "what does this rank keep after a step", whoever keeps it: the sharding code, the reducer,
  hooks, or a gathered buffer that was never freed.

A storage is counted once however many tensors view it (keyed by `untyped_storage().data_ptr()`).
Neither sees storages held only by C++ objects without a Python tensor (e.g. autograd saved tensors of
a graph still referenced from Python); numpy arrays and shared-memory segments are not tensors.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary


class LiveBytes(TorchDispatchMode):
    """Peak bytes of real storages that ops create while active (storages are freed by refcount)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {id(t.untyped_storage()) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            storage = t.untyped_storage()
            if id(storage) in inputs or storage in self._seen:
                continue
            self._seen[storage] = True
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, storage.nbytes())
        return out


@dataclass(frozen=True)
class Storage:
    nbytes: int
    example: str  # dtype and shape of one tensor viewing it, for messages


def _real(t: torch.Tensor) -> torch.UntypedStorage | None:
    if t.is_meta or t.layout is not torch.strided:
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return None
    return storage if storage.nbytes() and storage.data_ptr() else None


def _live_tensors() -> Iterator[torch.Tensor]:
    gc.collect()
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which deprecated module proxies (e.g.
        # torch.distributed.reduce_op) answer with a warning
        if not issubclass(type(obj), torch.Tensor):
            continue
        yield obj
        if obj.is_leaf and obj.grad is not None:  # a leaf's grad may have no Python object of its own
            yield obj.grad


def storages_of(tensors: Iterable[torch.Tensor | None]) -> dict[int, Storage]:
    """The distinct real storages behind `tensors` (views of one buffer count once), by data_ptr."""
    out: dict[int, Storage] = {}
    for t in tensors:
        if t is None:
            continue
        storage = _real(t)
        if storage is not None and storage.data_ptr() not in out:
            out[storage.data_ptr()] = Storage(storage.nbytes(), f"{t.dtype}{list(t.shape)}")
    return out


class LiveTensors:
    """A snapshot of the live storages; `since()` lists those that appeared after it.

    The snapshot keeps its tensors alive, so a storage freed later cannot hand its address to a new one.
    """

    def __init__(self) -> None:
        self._held = list(_live_tensors())
        self._ptrs = set(storages_of(self._held))

    def since(self, *, exclude: Iterable[torch.Tensor] = ()) -> dict[int, Storage]:
        """Storages alive now and not at the snapshot, less those behind `exclude`."""
        skip = self._ptrs | set(storages_of(exclude))
        return {ptr: s for ptr, s in storages_of(_live_tensors()).items() if ptr not in skip}


def total_bytes(storages: dict[int, Storage]) -> int:
    return sum(s.nbytes for s in storages.values())


def largest(storages: dict[int, Storage], n: int = 8) -> list[tuple[str, int]]:
    """The `n` biggest storages as (example tensor, bytes), for failure messages."""
    return sorted(((s.example, s.nbytes) for s in storages.values()), key=lambda x: -x[1])[:n]


def holders(ptrs: Iterable[int], n: int = 3, depth: int = 3) -> list[str]:
    """Who keeps the storages at `ptrs` alive: for up to `n` of them, the chain of referrer types of one
    tensor viewing each, `depth` levels up (dicts named by the object owning them). For failure messages:
    a storage that outlives its step is found by what holds it, not by guessing."""
    wanted = set(ptrs)
    out: list[str] = []
    for t in _live_tensors():
        storage = _real(t)
        if storage is None or storage.data_ptr() not in wanted:
            continue
        wanted.discard(storage.data_ptr())
        out.append(f"{t.dtype}{list(t.shape)} <- " + " <- ".join(_referrer_chain(t, depth)))
        if len(out) == n:
            break
    return out


def _referrer_chain(obj: object, depth: int) -> list[str]:
    """Each level: every referrer's name (frames and this walk's own lists left out), then up the first."""
    chain: list[str] = []
    for _ in range(depth):
        refs = [r for r in gc.get_referrers(obj) if type(r).__name__ not in ("frame", "cell", "generator", "list")]
        if not refs:
            break
        chain.append("|".join(sorted({_name(r) for r in refs})))
        obj = refs[0]
    return chain


def _name(obj: object) -> str:
    if isinstance(obj, dict):
        owners = [o for o in gc.get_referrers(obj) if getattr(o, "__dict__", None) is obj]
        return f"{type(owners[0]).__qualname__}.__dict__" if owners else f"dict{sorted(map(str, obj))[:3]}"
    return type(obj).__qualname__
