"""`@smp.step`: split a batch into micro-batches, run the step function on each, collect outputs.

Tensors (also inside mappings, lists and tuples, namedtuples included) are split along dim 0 into
`microbatches` equal pieces, each container rebuilt as its own type where it can be; an object with
SMP v1's `smp_slice(num_mb, mb, axis)` method is split by it; everything else is passed unchanged.
While the step runs, each micro-batch's gradient is added into the main grads times 1/microbatches
(whether the step calls `model.backward(loss)` or a plain `loss.backward()`; see [Note: micro-batch
averaging] in model.py) and the accumulation boundary falls after the last micro-batch, so the
gradients are the average over micro-batches -- the same as one backward on the whole batch.

What the function returns comes back in its own structure with a StepOutput of the micro-batches'
values in each place (SMP v1): `loss_mb, correct_mb = train_step(...)` for `return loss, correct`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from shardpar.runtime.model import DistributedModel


class StepOutput:
    """One returned value of a step function across micro-batches: `outputs[i]` is micro-batch i's.

    `@smp.step` returns the step function's own structure with a StepOutput in each place (SMP v1):
    `return loss, correct` gives a tuple of two StepOutputs, a dict gives a dict of them. The
    reductions follow v1's formulas: `reduce_mean` is the sum over micro-batches divided by their
    number (so integer counts give a float mean), `reduce_sum` the sum; both also take plain numbers.
    `concat` / `stack` join tensors along dim 0 / a new dim 0."""

    def __init__(self, outputs: list[Any] | tuple[Any, ...]) -> None:
        if not isinstance(outputs, (list, tuple)):
            raise TypeError(f"StepOutput takes a list of per-micro-batch values, got {type(outputs).__name__}")
        self.outputs = list(outputs)

    def _kinds(self) -> list[str]:
        return sorted({type(o).__name__ for o in self.outputs})

    def _tensors(self, what: str) -> list[torch.Tensor]:
        if not self.outputs or not all(isinstance(o, torch.Tensor) for o in self.outputs):
            raise TypeError(
                f"StepOutput.{what}() joins tensors, but the micro-batches returned {self._kinds()}; "
                "return tensors from the step function, or read the values from .outputs"
            )
        return [o.detach() for o in self.outputs]

    def _summable(self, what: str) -> list[Any]:
        if self.outputs and all(isinstance(o, torch.Tensor) for o in self.outputs):
            return [o.detach() for o in self.outputs]
        if self.outputs and all(isinstance(o, (int, float)) for o in self.outputs):
            return self.outputs
        raise TypeError(
            f"StepOutput.{what}() sums tensors or numbers, but the micro-batches returned {self._kinds()}; "
            "read the values from .outputs"
        )

    def reduce_mean(self) -> Any:
        """Mean over micro-batches (v1: their sum / their number)."""
        values = self._summable("reduce_mean")
        return _sum(values) / len(values)

    def reduce_sum(self) -> Any:
        return _sum(self._summable("reduce_sum"))

    def concat(self) -> torch.Tensor:
        return torch.cat(self._tensors("concat"), dim=0)

    def stack(self) -> torch.Tensor:
        return torch.stack(self._tensors("stack"))

    def map(self, func: Callable[[Any], Any]) -> StepOutput:
        """v1: apply `func` to each micro-batch's value, in place; returns this StepOutput."""
        self.outputs = [func(o) for o in self.outputs]
        return self

    def __len__(self) -> int:
        return len(self.outputs)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.outputs)

    def __getitem__(self, key: Any) -> Any:
        """`out[i]`: micro-batch i's value. `out["loss"]` where each micro-batch's value is a dict: a
        StepOutput of that entry across micro-batches (a StepOutput built from dicts by hand)."""
        if isinstance(key, (int, slice)) and not all(isinstance(o, Mapping) for o in self.outputs):
            return self.outputs[key]
        if not all(isinstance(o, Mapping) for o in self.outputs):
            raise TypeError(
                f"StepOutput[{key!r}]: the step returned {self._kinds()}, not dicts; index micro-batches by int"
            )
        return StepOutput([o[key] for o in self.outputs])

    def detach(self) -> StepOutput:
        """The same outputs, tensors detached from the graph (SMP v1)."""
        return StepOutput([_detached(o) for o in self.outputs])

    def __repr__(self) -> str:
        return f"StepOutput({self.outputs!r})"


def _sum(values: list[Any]) -> Any:
    """v1's `sum(outputs)`; for tensors one stacked sum (the same value, one kernel)."""
    if isinstance(values[0], torch.Tensor):
        try:
            return torch.stack(values).sum(dim=0)
        except RuntimeError:  # shapes that only broadcast: add them one by one, as v1's sum() did
            pass
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total


def find_empty(obj: Any, where: str = "") -> tuple[str, tuple[int, ...]] | None:
    """(where, shape) of the first tensor in `obj` that smp.step would split with a batch dimension
    of 0, or None. `where` reads like an index into the step function's arguments."""
    if isinstance(obj, torch.Tensor):
        return (where, tuple(obj.shape)) if obj.dim() > 0 and obj.shape[0] == 0 else None
    if isinstance(obj, Mapping):
        items: Any = ((f"{where}[{k!r}]", v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(obj))
    else:
        return None
    for path, value in items:
        found = find_empty(value, path)
        if found is not None:
            return found
    return None


def check_not_empty(args: tuple[Any, ...], kwargs: Mapping[str, Any], rank: int | None) -> None:
    """An empty batch is an error here, on the rank that has it: a mean over zero samples is NaN (and a
    sum gives zero gradients that still move momentum and weight decay), so it would train on nothing.
    Only this rank knows; the others fail at their next collective (collective_timeout_s at most, or at
    once where a launcher such as torchrun stops the job when one rank exits)."""
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"argument {k!r}", v) for k, v in kwargs.items()]
    for name, value in named:
        if isinstance(value, torch.nn.Module):
            continue
        found = find_empty(value)
        if found is not None:
            where, shape = found
            who = f"rank {rank}" if rank is not None else "this rank"
            raise ValueError(
                f"{who}: @smp.step got an empty batch: {name}{where} has shape {shape}, batch dimension 0. Every "
                "rank needs at least one sample per step (a loss over zero samples is NaN); check the sampler's "
                "length and drop_last, or how the data is split over ranks (smp.rdp_slice)"
            )


def split_batch(obj: Any, num: int, axis: int = 0) -> list[Any]:
    """`num` micro-batches of `obj` (tensors split on `axis`; containers recursed; objects with SMP v1's
    `smp_slice(num_mb, mb, axis)` sliced by it; others repeated)."""
    if isinstance(obj, StepOutput):  # SMP v1: an earlier step's output passes micro-batch i to micro-batch i
        if len(obj) != num:
            raise ValueError(
                f"@smp.step got a StepOutput of {len(obj)} micro-batches as an argument, but runs {num} micro-batches; "
                "pass it to a step with the same microbatches, or pass .concat() / .outputs instead"
            )
        return list(obj.outputs)
    smp_slice = getattr(obj, "smp_slice", None)
    if smp_slice is not None and not isinstance(obj, torch.Tensor) and callable(smp_slice):
        return [smp_slice(num, i, axis) for i in range(num)]
    if isinstance(obj, torch.Tensor) and obj.dim() > axis:
        if obj.shape[axis] % num:
            raise ValueError(
                f"microbatches={num} must divide the batch dimension {obj.shape[axis]} (axis {axis}) of a tensor of "
                f"shape {tuple(obj.shape)}; change the batch size or the microbatches knob"
            )
        return list(obj.chunk(num, dim=axis))
    if isinstance(obj, Mapping):
        parts = {k: split_batch(v, num, axis) for k, v in obj.items()}
        return [_rebuild_mapping(obj, {k: v[i] for k, v in parts.items()}) for i in range(num)]
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        parts_seq = [split_batch(v, num, axis) for v in obj]
        if hasattr(obj, "_fields"):  # a namedtuple takes its fields as arguments, not one iterable
            return [type(obj)(*(p[i] for p in parts_seq)) for i in range(num)]
        return [type(obj)(p[i] for p in parts_seq) for i in range(num)]
    return [obj] * num


def _rebuild_mapping(obj: Mapping[Any, Any], items: dict[Any, Any]) -> Mapping[Any, Any]:
    """A micro-batch of mapping `obj` holding `items`: the same type where it can be built from them."""
    cls: Any = type(obj)
    if isinstance(obj, defaultdict):  # its constructor wants the default factory first
        return cls(obj.default_factory, items)
    try:
        return cls(items)  # dict, OrderedDict, HF BatchEncoding, most dict-like classes
    except TypeError:
        # A constructor that wants other arguments: hand the step function every key in a plain dict
        # rather than fail on a container it never asked to have rebuilt.
        return items


@dataclass(frozen=True)
class StepOptions:
    """SMP v1's `@smp.step(...)` arguments."""

    non_split_inputs: tuple[str, ...] = ()  # argument names passed whole to every micro-batch
    input_split_axes: Mapping[str, int] = field(default_factory=dict)  # argument name -> batch axis
    detach_outputs: bool = True  # detach returned tensors (the graph is not kept alive after the step)


def make_step(
    fn: Callable[..., Any],
    *,
    find_model: Callable[[], DistributedModel | None],
    microbatches: Callable[[], int],
    options: StepOptions = StepOptions(),
) -> Callable[..., Any]:
    signature = inspect.signature(fn)
    for name in (*options.non_split_inputs, *options.input_split_axes):
        if name not in signature.parameters:
            raise ValueError(
                f"@smp.step: {name!r} (in non_split_inputs / input_split_axes) is not an argument of "
                f"{fn.__name__}{signature}; name arguments as they appear in its signature"
            )

    positional = [
        p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]

    def split(name: str, value: Any, num: int) -> list[Any]:
        if isinstance(value, torch.nn.Module) or name in options.non_split_inputs:
            return [value] * num
        return split_batch(value, num, options.input_split_axes.get(name, 0))

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        model = next((a for a in (*args, *kwargs.values()) if isinstance(a, DistributedModel)), None)
        model = model or find_model()
        num = microbatches()
        bound = signature.bind(*args, **kwargs)
        whole = set(options.non_split_inputs)  # not split, so not checked for an empty batch
        checked = tuple(None if i < len(positional) and positional[i] in whole else a for i, a in enumerate(args))
        check_not_empty(
            checked,
            {k: v for k, v in kwargs.items() if k not in whole},
            model.topology.rank if model is not None else None,
        )
        parts = {k: split(k, v, num) for k, v in bound.arguments.items()}
        outputs = []
        with model.window.in_step(num) if model is not None else contextlib.nullcontext():
            for i in range(num):
                call = signature.bind_partial()
                call.arguments.update({k: v[i] for k, v in parts.items()})
                out = fn(*call.args, **call.kwargs)
                outputs.append(_detached(out) if options.detach_outputs else out)
        if model is not None:
            model.run_post_step_hooks()
        return as_step_output(outputs)

    return wrapper


def as_step_output(outputs: list[Any], where: str = "the step function's return value") -> Any:
    """SMP v1's return structure: the step function's own structure (tuples -- namedtuples kept --,
    lists, dicts, nested) with a StepOutput of the micro-batches' values in each place. What is not a
    tuple, list or mapping -- a tensor, a number, None, any other object -- is a place. The micro-batches
    must return the same structure (the same keys, the same lengths)."""
    first = outputs[0]
    if isinstance(first, (list, tuple)) and not isinstance(first, torch.Size):

        def same_length(o: Any) -> bool:
            return isinstance(o, type(first)) and len(o) == len(first)

        _check_same(outputs, where, same_length, f"of {len(first)}")
        items = [as_step_output([o[i] for o in outputs], f"{where}[{i}]") for i in range(len(first))]
        return _rebuild_sequence(first, items)
    if isinstance(first, Mapping):
        keys = list(first.keys())

        def same_keys(o: Any) -> bool:  # in any order
            return isinstance(o, Mapping) and len(o) == len(keys) and all(k in o for k in keys)

        _check_same(outputs, where, same_keys, f"keys {keys}")
        built = {k: as_step_output([o[k] for o in outputs], f"{where}[{k!r}]") for k in keys}
        return _rebuild_mapping(first, built)
    return StepOutput(outputs)


def _rebuild_sequence(like: list[Any] | tuple[Any, ...], items: list[Any]) -> Any:
    """`items` in a sequence of `like`'s type where it can be built from them, else a plain tuple/list."""
    cls: Any = type(like)
    try:
        return cls(*items) if hasattr(like, "_fields") else cls(items)  # a namedtuple takes its fields as arguments
    except TypeError:
        return tuple(items) if isinstance(like, tuple) else items


def _check_same(outputs: list[Any], where: str, same: Callable[[Any], bool], shape: str) -> None:
    for i, o in enumerate(outputs):
        if not same(o):
            got = f"{type(o).__name__} of {len(o)}" if isinstance(o, (list, tuple, Mapping)) else type(o).__name__
            keys = f" with keys {list(o.keys())}" if isinstance(o, Mapping) else ""
            raise ValueError(
                f"@smp.step: micro-batch 0 returned a {type(outputs[0]).__name__} ({shape}) as {where}, micro-batch "
                f"{i} a {got}{keys}; every micro-batch must return the same structure (the same keys and lengths), "
                "so that each place holds one value per micro-batch"
            )


def _detached(obj: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), obj)
