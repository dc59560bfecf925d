"""Deferred parameter initialization: build a model on `meta`, materialise each tensor later, bit for bit.

    with deferred_init():
        model = GPT2LMHeadModel(cfg)        # every parameter/buffer is a meta tensor; nothing allocated
    full = materialize(model.lm_head.weight) # one full CPU tensor, equal to a normal CPU init's value

The idea is torchdistx's `deferred_init` (record the ops that build a tensor, replay them later); the
code here is our own and works on plain meta tensors, no tensor subclass.

[Note: deferred init record]
Inside `deferred_init()` a TorchFunctionMode sends device-less factory calls to `meta` and a
TorchDispatchMode records every aten op that touches a meta tensor. Records hang off a *root*, one
per meta storage:

    root ── creation: the op (+ output index) that made the storage, e.g. empty / arange / clone
         └─ log: in-place ops on the storage or any view of it, in order (normal_, fill_, copy_, ...)

Views need no record: a view shares its base's storage, so a tensor is found by its storage and its
own (size, stride, offset) picks the view out of the replayed base (`as_strided`). Tensor arguments
are stored as `_Ref(root, geometry, num_ops)`: the value of that view after the root's first
`num_ops` log entries, which makes `copy_` from a tensor that is changed later replay correctly.

Random ops carry the default CPU generator's state from just before them (`bytes`, 5056 B) and are
run once more at record time on a zero-filled CPU scratch of the same shape, so the global RNG ends
where a normal construction leaves it; the scratch is freed at once (one full tensor at a time).
Replay restores that state for the op and puts the generator back, so any materialisation order
gives the same values. An explicit `generator=` argument is recorded as its state and replayed on a
private generator. Replay always runs on CPU, because the CPU generator and CPU kernels are what a
normal CPU init uses; `materialize(device=...)` moves the result afterwards.

Memory: the record holds meta tensors' geometry, op references, Python scalars and RNG states; the
only real tensors it keeps are real *arguments* (e.g. `w.copy_(cpu_tensor)`, or a `torch.tensor(...)`
literal registered as a parameter/buffer), by reference, so mutating them later changes the replay.
`record_stats()` reports what a set of tensors' records hold.

A meta tensor made outside the context (accelerate's `init_empty_weights`) has no record;
`record_init()` gives it one after the fact by running an init function (an HF model's
`initialize_weights`) on it under the same recorder.

The table from storage to root is the one piece of process-wide state in this file: it is weak in
the storage, so a record lives exactly as long as some tensor on its storage (or a record that
depends on it) does.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._ops import OpOverload
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten
_CPU = torch.device("cpu")
_META = torch.device("meta")

# Factories that take `device=`; without one they land on meta inside the context. `torch.tensor`,
# `as_tensor` and `asarray` are left on CPU: they copy Python/NumPy data (small, and HF probes the
# context device with `torch.tensor([])` and skips `_init_weights` when it sees meta).
_FACTORIES = frozenset(
    {
        torch.empty,
        torch.empty_strided,
        torch.empty_permuted,
        torch.zeros,
        torch.ones,
        torch.full,
        torch.arange,
        torch.range,
        torch.linspace,
        torch.logspace,
        torch.eye,
        torch.rand,
        torch.randn,
        torch.randint,
        torch.randperm,
        torch.scalar_tensor,
        torch.tril_indices,
        torch.triu_indices,
        torch.bartlett_window,
        torch.blackman_window,
        torch.hamming_window,
        torch.hann_window,
        torch.kaiser_window,
    }
)
# [Note: inits that skip meta tensors]
# torch.nn.init's trunc_normal_ (a data-dependent rejection loop), orthogonal_, sparse_ and dirac_
# return early on a meta tensor, so neither their values nor their RNG draws would be recorded.
# Inside deferred_init() these names (in torch.nn.init, whose trunc_normal_ calls the private
# helper, and in HF's TORCH_INIT_FUNCTIONS table) point at wrappers that record the whole function
# as one in-place random op and run it on CPU scratch to advance the RNG. A reference taken
# elsewhere before the context (`from torch.nn.init import orthogonal_`) is not redirected.
_META_SKIPPING_INITS = ("_no_grad_trunc_normal_", "orthogonal_", "sparse_", "dirac_")
# Ops that read data out of a tensor: on a deferred input they run on its materialised value.
_DATA_READS = frozenset({aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default})


@dataclass(frozen=True)
class _Geometry:
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> _Geometry:
        return _Geometry(tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype)


@dataclass(frozen=True)
class _Call:
    """One recorded aten call; tensor arguments are `_Ref`/`_Const`, meta devices `_META`."""

    func: Callable[..., Any]  # an aten op, or a torch.nn.init function run as one op
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng_state: bytes | None  # default CPU generator state just before a random op


@dataclass(eq=False)
class _Root:
    """Everything that wrote one meta storage; see [Note: deferred init record]."""

    creation: _Call | None  # None: a meta storage made outside deferred_init(), values unknown
    out_index: int
    geometry: _Geometry
    log: list[_Call] = field(default_factory=list)


@dataclass(frozen=True)
class _Ref:
    root: _Root
    geometry: _Geometry
    num_ops: int


@dataclass(frozen=True)
class _Const:
    tensor: torch.Tensor  # a real tensor argument, kept by reference


@dataclass(frozen=True)
class _GenState:
    state: bytes  # an explicit torch.Generator argument, as it was before the op


_ROOTS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # UntypedStorage -> _Root


def _root_of(t: torch.Tensor) -> _Root:
    storage = t.untyped_storage()
    root = _ROOTS.get(storage)
    if root is None:  # a meta tensor from outside the context: record what is done to it, replay refuses
        root = _ROOTS[storage] = _Root(creation=None, out_index=0, geometry=_Geometry.of(t))
    return root


def _to_record(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if x.is_meta:
            root = _root_of(x)
            return _Ref(root, _Geometry.of(x), len(root.log))
        return _Const(x)
    if isinstance(x, torch.Generator):
        return _GenState(bytes(x.get_state().numpy()))
    if isinstance(x, torch.device) and x.type == "meta":
        return _META
    return x


def _is_random(func: OpOverload) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _mutated_tensors(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out += [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_meta]
    return out


def _advance_rng(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Run a random op on CPU scratch so the generator moves exactly as in a normal init."""

    def scratch(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_meta:  # zeros: valid for bernoulli p / normal std tensors
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=_CPU).zero_()
        if isinstance(x, torch.device) and x.type == "meta":
            return _CPU
        return x

    func(*pytree.tree_map(scratch, args), **pytree.tree_map(scratch, kwargs))


def _take_rng(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes | None:
    """The default generator's state before a random op (None if it gets an explicit one); advances it."""
    leaves = pytree.tree_leaves((args, kwargs))
    state = None if any(isinstance(x, torch.Generator) for x in leaves) else bytes(torch.get_rng_state().numpy())
    _advance_rng(func, args, kwargs)
    return state


def _append(call: _Call, mutated: list[torch.Tensor]) -> None:
    for root in {id(r): r for r in map(_root_of, mutated)}.values():
        root.log.append(call)


def _record(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    rec_args, rec_kwargs = pytree.tree_map(_to_record, (args, kwargs))  # before the op: refs see the old state
    rng_state = _take_rng(func, args, kwargs) if _is_random(func) else None
    out = func(*args, **kwargs)
    is_factory = not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves((args, kwargs)))
    if is_factory and "dtype" in rec_kwargs and rec_kwargs["dtype"] is None and isinstance(out, torch.Tensor):
        rec_kwargs = {**rec_kwargs, "dtype": out.dtype}  # pin the default dtype of the moment
    call = _Call(func, rec_args, rec_kwargs, rng_state)
    _append(call, _mutated_tensors(func, args, kwargs))
    for i, t in enumerate(pytree.tree_leaves(out)):
        if isinstance(t, torch.Tensor) and t.is_meta and t.untyped_storage() not in _ROOTS:
            _ROOTS[t.untyped_storage()] = _Root(creation=call, out_index=i, geometry=_Geometry.of(t))
    return out


def _recording() -> bool:
    return any(isinstance(m, _RecordingMode) for m in _get_current_dispatch_mode_stack())


def _opaque_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """Record a whole `torch.nn.init` function as one in-place random op on its first argument."""

    @functools.wraps(original)
    def deferred(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not (tensor.is_meta and _recording()):
            return original(tensor, *args, **kwargs)
        rec_args, rec_kwargs = pytree.tree_map(_to_record, ((tensor, *args), kwargs))
        _append(_Call(original, rec_args, rec_kwargs, _take_rng(original, (tensor, *args), kwargs)), [tensor])
        return tensor

    return deferred


@contextlib.contextmanager
def _patched_meta_skipping_inits() -> Iterator[None]:
    """See [Note: inits that skip meta tensors]."""
    tables: list[dict[str, Any]] = [vars(torch.nn.init)]
    hf_init = sys.modules.get("transformers.initialization")
    if isinstance(getattr(hf_init, "TORCH_INIT_FUNCTIONS", None), dict):
        tables.append(hf_init.TORCH_INIT_FUNCTIONS)  # type: ignore[union-attr]
    originals = {id(f): f for f in (getattr(torch.nn.init, name) for name in _META_SKIPPING_INITS)}
    patched = [(t, k, f) for t in tables for k, f in t.items() if callable(f) and id(f) in originals]
    wrappers = {id(f): _opaque_init(f) for f in originals.values()}
    for table, key, fn in patched:
        table[key] = wrappers[id(fn)]
    try:
        yield
    finally:
        for table, key, fn in patched:
            table[key] = fn


class _RecordingMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        if not any(
            (isinstance(x, torch.Tensor) and x.is_meta) or (isinstance(x, torch.device) and x.type == "meta")
            for x in leaves
        ):
            return func(*args, **kwargs)  # real tensors only: not ours to record
        if func in _DATA_READS:
            real = pytree.tree_map(lambda x: materialize(x) if isinstance(x, torch.Tensor) and x.is_meta else x, args)
            return func(*real, **kwargs)
        return _record(func, args, kwargs)


class _MetaFactoryMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None:
            kwargs["device"] = _META
        return func(*args, **kwargs)


def _defer_registered(module: nn.Module, name: str, tensor: torch.Tensor | None) -> torch.Tensor | None:
    """Registration hook: a real tensor that becomes a parameter/buffer is recorded and replaced by meta."""
    if tensor is None or tensor.is_meta:
        return None
    deferred = tensor.detach().to(_META)  # recorded as _to_copy(_Const(tensor))
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(deferred, requires_grad=tensor.requires_grad)
    return deferred


@contextlib.contextmanager
def deferred_init() -> Iterator[None]:
    """Build modules on `meta`, recording how each tensor gets its value; see [Note: deferred init record].

    Parameters and buffers created inside are meta tensors; `materialize()` later rebuilds any of
    them with exactly the values a normal CPU construction under the same RNG state would give, and
    the global CPU RNG leaves the context where a normal construction would leave it. HF models run
    their `_init_weights` as usual (the context is not reported as `meta` to their device probe).
    """
    if any(isinstance(m, _RecordingMode) for m in _get_current_dispatch_mode_stack()):
        raise ValueError("deferred_init() is already active; nesting it would record every op twice")
    hook = cast(Callable[..., None], _defer_registered)  # torch types these hooks as returning None; they may not
    handles = [
        module_hooks.register_module_parameter_registration_hook(hook),
        module_hooks.register_module_buffer_registration_hook(hook),
    ]
    try:
        with _patched_meta_skipping_inits(), _MetaFactoryMode(), _RecordingMode():
            yield
    finally:
        for handle in handles:
            handle.remove()


def is_deferred(tensor: torch.Tensor) -> bool:
    """True for a meta tensor whose value `materialize()` can rebuild."""
    if not tensor.is_meta:
        return False
    root = _ROOTS.get(tensor.untyped_storage())
    return root is not None and root.creation is not None


def _view(base: torch.Tensor, geometry: _Geometry) -> torch.Tensor:
    if geometry.dtype != base.dtype:
        raise ValueError(
            f"a deferred tensor of dtype {geometry.dtype} views a storage created as {base.dtype} "
            "(tensor.view(dtype)); deferred_init() cannot replay dtype-reinterpreting views, create the tensor "
            "outside deferred_init() or with its final dtype"
        )
    return base.as_strided(geometry.size, geometry.stride, geometry.offset)


def _with_geometry(real: torch.Tensor, geometry: _Geometry) -> torch.Tensor:
    """`real` laid out as the meta output was, so later `as_strided` views land on the same elements."""
    if _Geometry.of(real) == geometry:
        return real
    span = 1 + geometry.offset + sum(max(n - 1, 0) * s for n, s in zip(geometry.size, geometry.stride, strict=True))
    fresh = torch.empty(span, dtype=geometry.dtype, device=_CPU)
    return _view(fresh, geometry).copy_(real)


@dataclass(frozen=True)
class _Replaying:
    root: _Root
    num_ops: int
    base: torch.Tensor


def _resolve(x: Any, current: _Replaying | None) -> Any:
    if isinstance(x, _Ref):
        if current is not None and x.root is current.root and x.num_ops == current.num_ops:
            return _view(current.base, x.geometry)
        return _view(_replay(x.root, x.num_ops), x.geometry)
    if isinstance(x, _Const):
        return x.tensor
    if isinstance(x, _GenState):
        gen = torch.Generator(device=_CPU)
        gen.set_state(torch.frombuffer(bytearray(x.state), dtype=torch.uint8))
        return gen
    if isinstance(x, torch.device) and x.type == "meta":
        return _CPU
    return x


def _run(call: _Call, current: _Replaying | None) -> Any:
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


def _replay(root: _Root, num_ops: int) -> torch.Tensor:
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
    root = _ROOTS.get(tensor.untyped_storage())
    if root is None:
        raise _not_recorded()
    with torch.no_grad():
        base = _replay(root, len(root.log))
        out = _view(base, _Geometry.of(tensor))
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
    seen: dict[int, _Root] = {}
    todo = [_ROOTS[t.untyped_storage()] for t in tensors if is_deferred(t)]
    calls: list[_Call] = []
    while todo:
        root = todo.pop()
        if id(root) in seen:
            continue
        seen[id(root)] = root
        root_calls = ([root.creation] if root.creation else []) + root.log
        calls += root_calls
        todo += [x.root for c in root_calls for x in pytree.tree_leaves((c.args, c.kwargs)) if isinstance(x, _Ref)]
    unique = {id(c): c for c in calls}.values()
    consts = {id(x): x.tensor for c in unique for x in pytree.tree_leaves((c.args, c.kwargs)) if isinstance(x, _Const)}
    states = [c.rng_state for c in unique if c.rng_state is not None]
    return RecordStats(
        num_roots=len(seen),
        num_ops=len(unique),
        num_rng_states=len(states),
        rng_state_bytes=sum(map(len, states)),
        num_real_tensors=len(consts),
        max_real_numel=max((t.numel() for t in consts.values()), default=0),
    )


def record_init(tensors: Iterable[torch.Tensor], init: Callable[[], object], *, seed: int) -> list[torch.Tensor]:
    """Give meta tensors made outside `deferred_init()` (accelerate's `init_empty_weights()`,
    `torch.device("meta")`) a record by running `init` on them under the recorder, e.g. an HF model's
    `initialize_weights`; see [Note: deferred init record].

    Each such tensor's storage gets a creation (an uninitialised tensor of the storage's size) and then
    logs whatever `init` does to it, so `materialize()` replays exactly that init, one tensor at a time.
    Randomness comes from a forked CPU RNG seeded with `seed` (every rank that passes the same seed
    gets the same values; the global RNG is untouched). Returns the tensors `init` wrote to; a tensor
    it left alone stays unrecorded (`is_deferred()` False), because replaying only its creation would
    give uninitialised memory. `init` must not write real tensors it should keep: under the recorder
    ops on real tensors run as usual.
    """
    if _recording():
        raise ValueError("record_init() inside deferred_init(): tensors made there are recorded already")
    candidates: list[torch.Tensor] = []
    for t in tensors:
        storage = t.untyped_storage() if t.is_meta else None
        root = _ROOTS.get(storage) if storage is not None else None
        if storage is None or (root is not None and (root.creation is not None or root.log)):
            continue  # real, deferred already, or written outside a recorder: nothing we could replay
        if root is None or root.creation is None:
            numel = storage.nbytes() // t.element_size()
            creation = _Call(aten.empty.memory_format, ([numel],), {"dtype": t.dtype, "device": _META}, None)
            _ROOTS[storage] = _Root(creation=creation, out_index=0, geometry=_Geometry((numel,), (1,), 0, t.dtype))
        candidates.append(t)
    with torch.no_grad(), torch.random.fork_rng(devices=[]), _patched_meta_skipping_inits(), _RecordingMode():
        torch.manual_seed(seed)
        init()
    written = [t for t in candidates if _ROOTS[t.untyped_storage()].log]
    for t in candidates:
        if not _ROOTS[t.untyped_storage()].log:
            _ROOTS.pop(t.untyped_storage(), None)  # back to "not recorded"
    return written


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
