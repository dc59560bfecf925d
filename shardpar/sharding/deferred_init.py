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
are stored as `Ref(root, geometry, num_ops)`: the value of that view after the root's first
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

The records and their replay live in deferred_record.py; this file is the recorder. The table from
storage to root (`deferred_record.ROOTS`) is the one piece of process-wide state of the two: it is weak in
the storage, so a record lives exactly as long as some tensor on its storage (or a record that
depends on it) does.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._ops import OpOverload
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from shardpar.sharding.deferred_record import (
    ROOTS,
    Call,
    Const,
    GenState,
    Geometry,
    RecordStats,
    Ref,
    Root,
    is_deferred,
    materialize,
    materialize_by_reset,
    record_stats,
)

__all__ = [
    "RecordStats",
    "deferred_init",
    "is_deferred",
    "materialize",
    "materialize_by_reset",
    "record_init",
    "record_stats",
]

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


def _root_of(t: torch.Tensor) -> Root:
    storage = t.untyped_storage()
    root = ROOTS.get(storage)
    if root is None:  # a meta tensor from outside the context: record what is done to it, replay refuses
        root = ROOTS[storage] = Root(creation=None, out_index=0, geometry=Geometry.of(t))
    return root


def _to_record(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if x.is_meta:
            root = _root_of(x)
            return Ref(root, Geometry.of(x), len(root.log))
        return Const(x)
    if isinstance(x, torch.Generator):
        return GenState(bytes(x.get_state().numpy()))
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


def _append(call: Call, mutated: list[torch.Tensor]) -> None:
    for root in {id(r): r for r in map(_root_of, mutated)}.values():
        root.log.append(call)


def _record(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    rec_args, rec_kwargs = pytree.tree_map(_to_record, (args, kwargs))  # before the op: refs see the old state
    rng_state = _take_rng(func, args, kwargs) if _is_random(func) else None
    out = func(*args, **kwargs)
    is_factory = not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves((args, kwargs)))
    if is_factory and "dtype" in rec_kwargs and rec_kwargs["dtype"] is None and isinstance(out, torch.Tensor):
        rec_kwargs = {**rec_kwargs, "dtype": out.dtype}  # pin the default dtype of the moment
    call = Call(func, rec_args, rec_kwargs, rng_state)
    _append(call, _mutated_tensors(func, args, kwargs))
    for i, t in enumerate(pytree.tree_leaves(out)):
        if isinstance(t, torch.Tensor) and t.is_meta and t.untyped_storage() not in ROOTS:
            ROOTS[t.untyped_storage()] = Root(creation=call, out_index=i, geometry=Geometry.of(t))
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
        _append(Call(original, rec_args, rec_kwargs, _take_rng(original, (tensor, *args), kwargs)), [tensor])
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
    deferred = tensor.detach().to(_META)  # recorded as _to_copy(Const(tensor))
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
        root = ROOTS.get(storage) if storage is not None else None
        if storage is None or (root is not None and (root.creation is not None or root.log)):
            continue  # real, deferred already, or written outside a recorder: nothing we could replay
        if root is None or root.creation is None:
            numel = storage.nbytes() // t.element_size()
            creation = Call(aten.empty.memory_format, ([numel],), {"dtype": t.dtype, "device": _META}, None)
            ROOTS[storage] = Root(creation=creation, out_index=0, geometry=Geometry((numel,), (1,), 0, t.dtype))
        candidates.append(t)
    with torch.no_grad(), torch.random.fork_rng(devices=[]), _patched_meta_skipping_inits(), _RecordingMode():
        torch.manual_seed(seed)
        init()
    written = [t for t in candidates if ROOTS[t.untyped_storage()].log]
    for t in candidates:
        if not ROOTS[t.untyped_storage()].log:
            ROOTS.pop(t.untyped_storage(), None)  # back to "not recorded"
    return written
