"""ShardedTensor: a parameter (or its gradient, or optimizer state made from it) as torch sees it outside
forward -- the global shape, dim(), numel() and dtype of the original parameter, backed by this rank's
piece of it without a copy.

[Note: sharded parameters]
Outside a unit's forward and backward, `model.parameters()` yields one ShardedTensor parameter per
original parameter (runtime/user_params.py swaps them with the compute parameters on the modules; FSDP2
does the same with DTensor, _fsdp_param.py `to_sharded` / `to_unsharded`). DTensor cannot express our
layout: a unit's parameters lie end to end in one flat buffer cut into equal shards (sharding/layout.py),
so a rank holds a contiguous range of the *flattened* parameter, not whole rows -- the price of one
AllGather per unit straight into the parameters' views. So the wrapper keeps that range, `_local`
(a 1-D view of the unit's fp32 main shard, or of its main grad), and defines what torch may do with it:

  * element-wise ops (torch.Tag.pointwise, the `_foreach_*` family, copy_/zero_/fill_, *_like, clone,
    dtype casts) run on the local pieces and return ShardedTensors of the same layout, so a plain
    torch optimizer on `model.parameters()` updates exactly the elements a single process would, and
    writes them into the main shard itself (the unit refreshes its compute copy, unit.py);
    a plain tensor of the parameter's global shape takes part through this rank's piece of it
    (`p.copy_(full)` loads values); 0-d and one-element tensors broadcast as usual;
  * whole-tensor reductions (norms, sum, mean, max/min, all/any without `dim`) reduce the local piece
    and then over the sharding group (and the TP group for a TP-split parameter): one collective per
    call, and `_foreach_norm` one for the whole list, so `torch.nn.utils.clip_grad_norm_` returns the
    true global norm. Every rank must make the call, as with any collective;
  * a persistent parameter (replicated, not TP-split) is whole on every rank: any op runs on it as on a
    plain tensor;
  * anything else that needs the full values -- matmuls, reductions along a dim (Adafactor's row and
    column means), reshapes, indexing, random fills -- raises TypeError naming the op and the
    parameter, before it computes anything. Silently computing on a piece is the one outcome we rule out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.optim.optimizer as _optim_impl
import torch.utils._foreach_utils as _foreach_impl

from shardpar.runtime import dcp_chunks, deepspeed_views
from shardpar.runtime.shard_layout import ShardComm, ShardLayout, refusal
from shardpar.runtime.sharded_gather import full_value
from shardpar.runtime.sharded_reductions import finish_norm, norm_parts, reduce_scalars

__all__ = ["ShardComm", "ShardLayout", "ShardedTensor", "sharded_parameter"]

aten = torch.ops.aten


class ShardedTensor(torch.Tensor):
    """A tensor with a parameter's full shape whose values are this rank's piece ([Note: sharded parameters])."""

    _local: torch.Tensor
    _layout: ShardLayout
    __slots__ = ("_layout", "_local")

    @staticmethod
    def __new__(cls, local: torch.Tensor, layout: ShardLayout, requires_grad: bool = False) -> ShardedTensor:
        expected = layout.length if layout.sharded else math.prod(layout.local_shape)
        if local.numel() != expected:
            raise AssertionError(f"{layout.fqn}: local piece of {local.numel()} elements, layout says {expected}")
        t = torch.Tensor._make_wrapper_subclass(
            cls, layout.shape, dtype=local.dtype, device=local.device, requires_grad=requires_grad
        )
        t._local = local if layout.sharded else local.view(layout.local_shape)
        t._layout = layout
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ShardedTensor({self._layout.describe()}, shape={list(self.shape)}, dtype={self.dtype})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"{self._layout.describe()} holds only this rank's piece; to save full values use model.state_dict() "
            "(every rank calls it) or smp.save_checkpoint"
        )

    # The wrapper owns no memory (its own storage is a placeholder of the global size): what it holds is
    # its local piece, so the storage and data pointer a script inspects are the piece's.
    def untyped_storage(self) -> torch.UntypedStorage:
        return self._local.untyped_storage()

    def data_ptr(self) -> int:
        return self._local.data_ptr()

    # `.data`: an alias of the same piece; assigning copies values in (this rank's piece of a full
    # tensor, or another piece of the same layout), never rebinding the wrapper to memory that the main
    # shard and the optimizer would not see (nn.Module._apply, e.g. `module.half()`, assigns `.data`).
    @property
    def data(self) -> ShardedTensor:
        return ShardedTensor(self._local, self._layout)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if isinstance(value, ShardedTensor) and value._local is self._local:
            return
        if value.dtype != self.dtype or value.device != self.device:
            raise ValueError(
                f"{self._layout.describe()}: `.data` of {value.dtype} on {value.device} for a parameter of "
                f"{self.dtype} on {self.device}: shardpar's parameters are views of the fp32 main shards and "
                "keep their dtype and device (set bf16/fp16 in smp.init for mixed precision)"
            )
        with torch.no_grad():
            self.copy_(value)

    @property
    def local_piece(self) -> torch.Tensor:
        """This rank's elements: flat when sharded, the module's (TP-local) shape when persistent."""
        _use(self)
        return self._local

    @property
    def shard_layout(self) -> ShardLayout:  # not `layout`: torch.Tensor.layout is torch.strided
        return self._layout

    def full_tensor(self) -> torch.Tensor:
        """DTensor's `full_tensor()`: a plain tensor of the global shape with every rank's values (a
        collective over the sharding and TP groups: every rank calls it, as with DTensor)."""
        _use(self)
        return full_value(self._local, self._layout)

    # torch.distributed.checkpoint's protocol (DTensor's): this rank's chunks, as views (dcp_chunks.py)
    def __create_chunk_list__(self) -> list[Any]:
        return dcp_chunks.chunk_list(self._layout)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        _use(self)
        return dcp_chunks.write_items(fqn, self._local, self._layout)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        _use(self)
        return dcp_chunks.tensor_shard(self._local, self._layout, index)

    # SMP v1's DeepSpeed names (AWS's templates read them when sdp > 1): deepspeed_views.py.
    @property
    def ds_tensor(self) -> torch.Tensor:
        """This rank's partition of the parameter (a 1-D view with `.ds_numel`)."""
        _use(self)
        return deepspeed_views.ds_tensor(self._local, self._layout)

    @property
    def ds_param_shard_group(self) -> Any:
        """The torch.distributed process group this parameter's partitions split over."""
        return deepspeed_views.process_group(self._layout.comm.sharding)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func not in _ALIAS:  # a detach or alias reads nothing (nn.Parameter() detaches at wrap)
            tensors = (t for a in args for t in (a if isinstance(a, list | tuple) else (a,)))  # lists: _foreach ops
            _call_each_once(t._layout.on_use for t in tensors if isinstance(t, ShardedTensor))
        return _dispatch(func, args, kwargs or {})


def _use(t: ShardedTensor) -> None:
    if t._layout.on_use is not None:
        t._layout.on_use()


# ---- dispatch ------------------------------------------------------------------------------------

_ALIAS = {aten.detach.default, aten.alias.default}
# Not tagged pointwise, but element-wise all the same (each output element from the same input element).
_ELEMENTWISE = {
    aten.copy_.default,
    aten.zero_.default,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.clone.default,
    aten._to_copy.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.where.self,
    aten.clamp.default,
    aten.clamp_.default,
    aten.clamp_min.default,
    aten.clamp_min_.default,
    aten.clamp_max.default,
    aten.clamp_max_.default,
}
# Random fills would draw other numbers than one process does over the full tensor.
_RANDOM = {torch.Tag.nondeterministic_seeded}


def _dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if func in _ALIAS:
        t = args[0]
        return ShardedTensor(func(t._local), t._layout)
    if func in _REDUCTIONS:
        return _REDUCTIONS[func](*args, **kwargs)
    name = func.__name__
    if name.startswith("_foreach_"):
        return _foreach(func, args, kwargs)
    if (torch.Tag.pointwise in func.tags or func in _ELEMENTWISE) and not _RANDOM.intersection(func.tags):
        return _elementwise(func, args, kwargs)
    return _whole_or_refuse(func, args, kwargs)


def _first_layout(values: Sequence[Any]) -> ShardLayout | None:
    for v in values:
        if isinstance(v, ShardedTensor):
            return v._layout
    return None


def _unwrap(value: Any, layout: ShardLayout, func: Any) -> Any:
    """One argument of an element-wise op on `layout`'s piece, as a plain tensor."""
    if isinstance(value, ShardedTensor):
        other = value._layout
        if other is not layout and (other.shape, other.start, other.length, other.sharded, other.tp) != (
            layout.shape,
            layout.start,
            layout.length,
            layout.sharded,
            layout.tp,
        ):
            raise TypeError(f"{func}: {layout.describe()} and {other.describe()} hold different pieces")
        return value._local
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() > 1:
        if tuple(value.shape) != tuple(layout.shape):
            raise TypeError(
                f"{func}: a plain tensor of shape {list(value.shape)} with {layout.describe()}: only 0-d or "
                f"one-element tensors and tensors of the parameter's full shape {list(layout.shape)} combine with it"
            )
        return layout.piece_of(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v, layout, func) for v in value)
    return value


def _is_inplace(func: Any) -> bool:
    return bool(func._schema.name.endswith("_"))


def _elementwise(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    layout = _first_layout(args) or _first_layout(list(kwargs.values()))
    if layout is None:
        raise AssertionError(f"{func} dispatched to ShardedTensor without one")
    if isinstance(args[0], torch.Tensor) and not isinstance(args[0], ShardedTensor) and _is_inplace(func):
        raise TypeError(
            f"{func} writes a plain tensor from {layout.describe()}: that needs the full values; "
            "gather them with model.state_dict() (every rank calls it) first"
        )
    if _is_inplace(func):
        _will_write([args[0]])
    out = func(*(_unwrap(a, layout, func) for a in args), **{k: _unwrap(v, layout, func) for k, v in kwargs.items()})
    if _is_inplace(func):
        _written([args[0]])
        return args[0]
    return _wrap(out, layout)


def _call_each_once(hooks: Iterable[Callable[[], None] | None]) -> None:
    """Call each distinct layout hook once: the tensors of one op often share a layout's."""
    for hook in {id(h): h for h in hooks if h is not None}.values():
        hook()


def _will_write(targets: Sequence[Any]) -> None:
    """Before an in-place op: let the owners of the layouts wait for readers of the old values."""
    _call_each_once(t._layout.before_write for t in targets if isinstance(t, ShardedTensor))


def _written(targets: Sequence[Any]) -> None:
    """Tell the owners of the layouts an in-place op wrote."""
    _call_each_once(t._layout.on_write for t in targets if isinstance(t, ShardedTensor))


def _wrap(out: Any, layout: ShardLayout) -> Any:
    if isinstance(out, torch.Tensor):
        return ShardedTensor(out, layout)
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap(o, layout) for o in out)
    return out


def _foreach(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`_foreach_*` ops: index i of every list argument is one element-wise op on list[0][i]'s layout."""
    if func in _FOREACH_REDUCTIONS:
        return _FOREACH_REDUCTIONS[func](*args, **kwargs)
    lists = [a for a in args if isinstance(a, (list, tuple))]
    n = len(lists[0])
    layouts = [_first_layout([lst[i] for lst in lists]) for i in range(n)]
    unwrapped = []
    for a in args:
        if isinstance(a, (list, tuple)):
            pairs = zip(a, layouts, strict=True)
            unwrapped.append([_unwrap(v, lay, func) if lay is not None else v for v, lay in pairs])
        else:
            unwrapped.append(a)
    if _is_inplace(func):
        _will_write(args[0])
    out = func(*unwrapped, **kwargs)
    if out is None:  # in place
        _written(args[0])
        return None
    return [ShardedTensor(o, lay) if lay is not None else o for o, lay in zip(out, layouts, strict=True)]


def _whole_or_refuse(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Ops that need every element: run them on persistent (whole) pieces, refuse them on shards."""
    wrapped = [a for a in (*args, *kwargs.values()) if isinstance(a, ShardedTensor)]
    partial = [t._layout for t in wrapped if not t._layout.whole]
    if partial:
        raise TypeError(refusal(func, partial[0]))

    def whole(v: Any) -> Any:
        if isinstance(v, ShardedTensor):
            return v._local
        if isinstance(v, (list, tuple)):
            return type(v)(whole(x) for x in v)
        return v

    if _is_inplace(func):
        _will_write([args[0]])
    out = func(*(whole(a) for a in args), **{k: whole(v) for k, v in kwargs.items()})
    if _is_inplace(func):
        _written([args[0]])
        return args[0]
    return out


# ---- whole-tensor reductions ----------------------------------------------------------------------


def _norm_taken(tensors: Sequence[Any]) -> None:
    """Tell the owners of the layouts a norm was taken of (once each; [Note: a user's own clip])."""
    calls = {id(t._layout.on_norm): t._layout.on_norm for t in tensors if isinstance(t, ShardedTensor)}
    for call in calls.values():
        if call is not None:
            call()


def _vector_norm(
    t: ShardedTensor, ord: float = 2, dim: Any = None, keepdim: bool = False, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    if dim not in (None, [], ()):
        raise TypeError(refusal("linalg_vector_norm(dim=...)", t._layout))
    _norm_taken([t])
    if not t._layout.split:  # every element here: torch's own kernel, the one-process result to the bit
        out = torch.linalg.vector_norm(t._local, ord, dtype=dtype)
    else:
        local = t._local if dtype is None else t._local.to(dtype)
        parts, combine = norm_parts([local], float(ord))
        out = finish_norm(reduce_scalars(parts, [t._layout], combine)[0], float(ord))
    return out.reshape([1] * t.dim()) if keepdim else out


def _foreach_norm(tensors: Sequence[torch.Tensor], ord: float = 2, dtype: torch.dtype | None = None) -> list[Any]:
    _norm_taken(tensors)
    # Tensors whose every element is on this rank (plain ones, persistent or unsplit parameters) take
    # torch's own kernel, so their norms are the one-process ones to the bit; the split ones are finished
    # over their groups, one collective per group for the whole list.
    idx = [i for i, t in enumerate(tensors) if isinstance(t, ShardedTensor) and t._layout.split]
    out: list[Any] = [None] * len(tensors)
    plain = [i for i in range(len(tensors)) if i not in set(idx)]
    if plain:
        whole = [t._local if isinstance(t, ShardedTensor) else t for t in (tensors[i] for i in plain)]
        for i, n in zip(plain, torch._foreach_norm(whole, ord, dtype=dtype), strict=True):
            out[i] = n
    if idx:
        locals_ = [tensors[i]._local if dtype is None else tensors[i]._local.to(dtype) for i in idx]  # type: ignore[attr-defined]
        parts, combine = norm_parts(locals_, float(ord))
        totals = reduce_scalars(parts, [tensors[i]._layout for i in idx], combine)  # type: ignore[attr-defined]
        for i, total in zip(idx, totals, strict=True):
            out[i] = finish_norm(total, float(ord))
    return out


def _whole_reduction(op: str) -> Callable[..., torch.Tensor]:
    def reduce(t: ShardedTensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs.get("dim") is not None:
            raise TypeError(refusal(f"{op}(dim=...)", t._layout))
        local, layout = t._local, t._layout
        if op in ("sum", "mean"):
            part = local.sum(dtype=kwargs.get("dtype"))
            total = reduce_scalars([part], [layout], "sum")[0]
            return total / t.numel() if op == "mean" else total
        if op in ("all", "any"):
            hits = (local.bool() if op == "any" else ~local.bool()).sum().float()
            total = reduce_scalars([hits], [layout], "sum")[0]
            return total > 0 if op == "any" else total == 0
        extreme = "max" if op in ("max", "amax") else "min"
        if not local.numel():  # an empty piece must not win
            part = local.new_full((), -math.inf if extreme == "max" else math.inf)
        else:
            part = local.amax() if extreme == "max" else local.amin()
        return reduce_scalars([part], [layout], extreme)[0].to(t.dtype)

    return reduce


_REDUCTIONS: dict[Any, Callable[..., Any]] = {
    aten.linalg_vector_norm.default: _vector_norm,
    aten.sum.default: _whole_reduction("sum"),
    aten.sum.dim_IntList: _whole_reduction("sum"),
    aten.mean.default: _whole_reduction("mean"),
    aten.mean.dim: _whole_reduction("mean"),
    aten.all.default: _whole_reduction("all"),
    aten.any.default: _whole_reduction("any"),
    aten.max.default: _whole_reduction("max"),
    aten.min.default: _whole_reduction("min"),
    aten.amax.default: _whole_reduction("amax"),
    aten.amin.default: _whole_reduction("amin"),
}
_FOREACH_REDUCTIONS: dict[Any, Callable[..., Any]] = {aten._foreach_norm.Scalar: _foreach_norm}


def _register_foreach_support() -> None:
    """Let torch's optimizers and clip_grad_norm_ take their foreach paths with ShardedTensors, as
    torch.distributed.tensor registers DTensor (one `_foreach_norm` = one collective for the model)."""
    for types in (_optim_impl._foreach_supported_types, _foreach_impl._foreach_supported_types):
        if ShardedTensor not in types:
            types.append(ShardedTensor)  # type: ignore[arg-type]


_register_foreach_support()


def sharded_parameter(local: torch.Tensor, layout: ShardLayout, *, requires_grad: bool) -> ShardedTensor:
    """The parameter form of a ShardedTensor: `nn.Parameter(ShardedTensor)` keeps the subclass and marks
    it a parameter (isinstance(p, nn.Parameter) holds), as FSDP2 does with DTensor."""
    param = torch.nn.Parameter(ShardedTensor(local, layout), requires_grad=requires_grad)
    if not isinstance(param, ShardedTensor):
        raise AssertionError(f"nn.Parameter dropped the ShardedTensor subclass of {layout.fqn}")
    return param
