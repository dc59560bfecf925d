"""The record behind a deferred tensor, and its replay: `materialize()` rebuilds a tensor that
`deferred_init()` (deferred_init.py, the recorder) built on `meta`; see [Note: deferred init record]
there for what a record holds and why replay gives the same bits as a normal CPU init.

    root (one per meta storage) -- creation: the Call that made the storage
                                 +- log: the in-place Calls on it or any view, in order
    Ref(root, geometry, num_ops) -- a tensor argument: that view after the root's first num_ops log entries

`materialize_by_reset()` is the fallback for meta tensors nobody recorded.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Geometry:
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> Geometry:
        return Geometry(tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype)


@dataclass(frozen=True)
class Call:
    """One recorded aten call; tensor arguments are `Ref`/`Const`, meta devices `_META`."""

    func: Callable[..., Any]  # an aten op, or a torch.nn.init function run as one op
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng_state: bytes | None  # default CPU generator state just before a random op


@dataclass(eq=False)
class Root:
    """Everything that wrote one meta storage; see [Note: deferred init record]."""

    creation: Call | None  # None: a meta storage made outside deferred_init(), values unknown
    out_index: int
    geometry: Geometry
    log: list[Call] = field(default_factory=list)


@dataclass(frozen=True)
class Ref:
    root: Root
    geometry: Geometry
    num_ops: int


@dataclass(frozen=True)
class Const:
    tensor: torch.Tensor  # a real tensor argument, kept by reference


@dataclass(frozen=True)
class GenState:
    state: bytes  # an explicit torch.Generator argument, as it was before the op


ROOTS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # UntypedStorage -> Root


def is_deferred(tensor: torch.Tensor) -> bool:
    """True for a meta tensor whose value `materialize()` can rebuild."""
    if not tensor.is_meta:
        return False
    root = ROOTS.get(tensor.untyped_storage())
    return root is not None and root.creation is not None


def _view(base: torch.Tensor, geometry: Geometry) -> torch.Tensor:
    if geometry.dtype != base.dtype:
        raise ValueError(
            f"a deferred tensor of dtype {geometry.dtype} views a storage created as {base.dtype} "
            "(tensor.view(dtype)); deferred_init() cannot replay dtype-reinterpreting views, create the tensor "
            "outside deferred_init() or with its final dtype"
        )
    return base.as_strided(geometry.size, geometry.stride, geometry.offset)


def _with_geometry(real: torch.Tensor, geometry: Geometry) -> torch.Tensor:
    """`real` laid out as the meta output was, so later `as_strided` views land on the same elements."""
    if Geometry.of(real) == geometry:
        return real
    span = 1 + geometry.offset + sum(max(n - 1, 0) * s for n, s in zip(geometry.size, geometry.stride, strict=True))
    fresh = torch.empty(span, dtype=geometry.dtype, device=_CPU)
    return _view(fresh, geometry).copy_(real)


@dataclass(frozen=True)
class _Replaying:
    root: Root
    num_ops: int
    base: torch.Tensor


def _resolve(x: Any, current: _Replaying | None) -> Any:
    if isinstance(x, Ref):
        if current is not None and x.root is current.root and x.num_ops == current.num_ops:
            return _view(current.base, x.geometry)
        return _view(_replay(x.root, x.num_ops), x.geometry)
    if isinstance(x, Const):
        return x.tensor
    if isinstance(x, GenState):
        gen = torch.Generator(device=_CPU)
        gen.set_state(torch.frombuffer(bytearray(x.state), dtype=torch.uint8))
        return gen
    if isinstance(x, torch.device) and x.type == "meta":
        return _CPU
    return x


def _run(call: Call, current: _Replaying | None) -> Any:
    args, kwargs = pytree.tree_map(lambda x: _resolve(x, current), (call.args, call.kwargs))
    if call.rng_state is None:
        return call.func(*args, **kwargs)
    saved = torch.get_rng_state()
    torch.set_rng_state(torch.frombuffer(bytearray(call.rng_state), dtype=torch.uint8))
    try:
        return call.func(*args, **kwargs)
    finally:
        torch.set_rng_state(saved)


def _not_recorded() -> ValueError:
    return ValueError(
        "this meta tensor was not created under shardpar's deferred_init() (e.g. accelerate's "
        "init_empty_weights(), torch.device('meta'), or a cast/copy made after the context), so its values were "
        "never recorded; build (and cast) the model under deferred_init(), or use materialize_by_reset(module, name)"
    )


def _replay(root: Root, num_ops: int) -> torch.Tensor:
    """A real CPU tensor laid out like `root`'s storage after its first `num_ops` log entries."""
    if root.creation is None:
        raise _not_recorded()
    out = pytree.tree_leaves(_run(root.creation, None))[root.out_index]
    base = _with_geometry(out, root.geometry)
    for i, call in enumerate(root.log[:num_ops]):
        _run(call, _Replaying(root, i, base))
    return base


def materialize(tensor: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """The full value of a deferred tensor, equal bit for bit to a normal CPU init's; see [Note: deferred init record].

    Replays the tensor's recorded ops (and those of tensors it was copied from) on CPU, then moves the
    result to `device`. Peak memory is the tensor's storage plus whatever its dependencies need, freed
    on return. Returns a plain tensor (not a Parameter, `requires_grad=False`); the global RNG is left
    untouched. Raises ValueError for a tensor that `is_deferred()` rejects.
    """
    if not tensor.is_meta:
        raise ValueError(f"materialize() needs a meta tensor from deferred_init(); got one on {tensor.device}")
    root = ROOTS.get(tensor.untyped_storage())
    if root is None:
        raise _not_recorded()
    with torch.no_grad():
        base = _replay(root, len(root.log))
        out = _view(base, Geometry.of(tensor))
        if out.numel() * out.element_size() < base.untyped_storage().nbytes():
            out = out.clone()  # a view of a larger storage: do not keep the whole storage alive
        return out.to(device)


@dataclass(frozen=True)
class RecordStats:
    """What the records behind some deferred tensors hold (dependencies included)."""

    num_roots: int
    num_ops: int
    num_rng_states: int
    rng_state_bytes: int
    num_real_tensors: int
    max_real_numel: int


def record_stats(tensors: Iterable[torch.Tensor]) -> RecordStats:
    """Walk the records of `tensors` and count what they keep alive; for memory checks and logs."""
    seen: dict[int, Root] = {}
    todo = [ROOTS[t.untyped_storage()] for t in tensors if is_deferred(t)]
    calls: list[Call] = []
    while todo:
        root = todo.pop()
        if id(root) in seen:
            continue
        seen[id(root)] = root
        root_calls = ([root.creation] if root.creation else []) + root.log
        calls += root_calls
        todo += [x.root for c in root_calls for x in pytree.tree_leaves((c.args, c.kwargs)) if isinstance(x, Ref)]
    unique = {id(c): c for c in calls}.values()
    consts = {id(x): x.tensor for c in unique for x in pytree.tree_leaves((c.args, c.kwargs)) if isinstance(x, Const)}
    states = [c.rng_state for c in unique if c.rng_state is not None]
    return RecordStats(
        num_roots=len(seen),
        num_ops=len(unique),
        num_rng_states=len(states),
        rng_state_bytes=sum(map(len, states)),
        num_real_tensors=len(consts),
        max_real_numel=max((t.numel() for t in consts.values()), default=0),
    )


def record_digest(tensors: Iterable[torch.Tensor]) -> bytes:
    """A digest of everything the replay of `tensors` reads: each record's ops with their arguments,
    RNG states and real tensor arguments (bytes), walked in the order of `tensors`. Equal digests on two
    ranks mean `materialize()` gives both the same bits; a tensor without a record (a real one, or an
    unrecorded meta one) counts by its shape and dtype alone. An argument whose repr names an object's
    address differs between processes: it only makes equal records look different, the safe side."""
    h = hashlib.sha256()
    index: dict[int, int] = {}

    def leaf(x: Any) -> None:
        if isinstance(x, Ref):
            root(x.root)
            h.update(repr(("ref", index[id(x.root)], x.geometry, x.num_ops)).encode())
        elif isinstance(x, Const):
            t = x.tensor.detach()
            h.update(repr(("const", tuple(t.shape), t.dtype)).encode())
            # a copy first: .numpy() of the constant's own storage would make it non-resizable
            h.update(t.reshape(-1).to("cpu", copy=True).view(torch.uint8).numpy().data)
        elif isinstance(x, GenState):
            h.update(b"generator" + x.state)
        else:
            h.update(repr(x).encode())

    def call(c: Call) -> None:
        h.update(repr(("call", getattr(c.func, "__qualname__", None) or str(c.func))).encode())
        h.update(c.rng_state or b"")
        for x in pytree.tree_leaves((c.args, sorted(c.kwargs.items()))):
            leaf(x)

    def root(r: Root) -> None:
        if id(r) in index:
            return
        index[id(r)] = len(index)
        h.update(repr(("root", r.out_index, r.geometry)).encode())
        for c in ([r.creation] if r.creation else []) + r.log:
            call(c)

    for t in tensors:
        r = ROOTS.get(t.untyped_storage()) if t.is_meta else None
        h.update(repr(("tensor", tuple(t.shape), t.dtype, r is not None)).encode())
        if r is not None:
            root(r)
            h.update(repr(Geometry.of(t)).encode())
    return h.digest()


def materialize_by_reset(
    module: nn.Module, name: str, *, device: torch.device | str = "cpu", seed: int | None = None
) -> torch.Tensor:
    """Fallback for meta tensors with no record (accelerate's `init_empty_weights()`, `torch.device("meta")`).

    Runs the owning submodule's `reset_parameters()` on fresh real copies of that submodule's own
    parameters and buffers (children stay meta and untouched) and returns the one named `name`.
    The values therefore match only the module's *own* init (e.g. kaiming-uniform for nn.Linear),
    NOT an HF model's `_init_weights` (normal(0, initializer_range), scaled residual projections,
    ...), and not a normal construction's RNG sequence. Each call resets the whole submodule once, so
    holds that submodule's direct tensors in full. Randomness comes from the global CPU RNG (advanced)
    or, with `seed`, from a forked RNG seeded with it: pass one so that every rank builds the same
    values before keeping its shard.
    """
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if not callable(getattr(owner, "reset_parameters", None)):
        raise ValueError(
            f"{name!r} belongs to {type(owner).__name__} ({owner_name or 'the root module'}), which has no "
            "reset_parameters(), so its values cannot be rebuilt; build the model under deferred_init() instead"
        )
    if leaf not in owner._parameters and leaf not in owner._buffers:
        raise ValueError(f"{name!r} is not a direct parameter or buffer of {type(owner).__name__}")
    scratch = copy.copy(owner)  # shallow: own tensor tables, so the model's Parameters stay untouched
    scratch._parameters = {
        k: None if p is None else nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
        for k, p in owner._parameters.items()
    }
    scratch._buffers = {k: None if b is None else torch.empty_like(b, device=device) for k, b in owner._buffers.items()}
    with torch.no_grad(), torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        scratch.reset_parameters()  # type: ignore[operator]
    out = scratch._parameters[leaf] if leaf in scratch._parameters else scratch._buffers[leaf]
    if out is None:
        raise ValueError(f"{name!r} is None on {type(owner).__name__}; there is nothing to materialise")
    return out.detach()
