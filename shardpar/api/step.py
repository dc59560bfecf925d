"""`@smp.step`: split a batch into micro-batches, run the step function on each, collect outputs.

Tensors (also inside mappings, lists and tuples, namedtuples included) are split along dim 0 into
`microbatches` equal pieces, each container rebuilt as its own type where it can be; an object with
SMP v1's `smp_slice(num_mb, mb, axis)` method is split by it; everything else is passed unchanged.
While the step runs, each micro-batch's gradient is added into the main grads times 1/microbatches
(whether the step calls `model.backward(loss)` or a plain `loss.backward()`; see [Note: micro-batch
averaging] in model.py) and the accumulation boundary falls after the last micro-batch, so the
gradients are the average over micro-batches -- the same as one backward on the whole batch.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from shardpar.runtime.model import DistributedModel


class StepOutput:
    """The per-micro-batch return values of a step function."""

    def __init__(self, outputs: list[Any]) -> None:
        self.outputs = outputs

    def _tensors(self) -> list[torch.Tensor]:
        if not all(isinstance(o, torch.Tensor) for o in self.outputs):
            kinds = sorted({type(o).__name__ for o in self.outputs})
            raise TypeError(f"StepOutput reductions need tensor outputs, got {kinds}; use .outputs")
        return [o.detach() for o in self.outputs]

    def reduce_mean(self) -> torch.Tensor:
        """Mean over micro-batches."""
        return torch.stack(self._tensors()).mean(dim=0)

    def reduce_sum(self) -> torch.Tensor:
        return torch.stack(self._tensors()).sum(dim=0)

    def concat(self) -> torch.Tensor:
        return torch.cat(self._tensors(), dim=0)

    def stack(self) -> torch.Tensor:
        return torch.stack(self._tensors())

    def __len__(self) -> int:
        return len(self.outputs)

    def __getitem__(self, key: Any) -> Any:
        """`out[i]`: micro-batch i's output. `out["loss"]` (outputs that are dicts, as SMP v1 returned
        them): a StepOutput of that entry across micro-batches, so `out["loss"].reduce_mean()` works."""
        if isinstance(key, int) and not all(isinstance(o, Mapping) for o in self.outputs):
            return self.outputs[key]
        if not all(isinstance(o, Mapping) for o in self.outputs):
            kinds = sorted({type(o).__name__ for o in self.outputs})
            raise TypeError(f"StepOutput[{key!r}]: the step returned {kinds}, not dicts; index micro-batches by int")
        return StepOutput([o[key] for o in self.outputs])

    def detach(self) -> StepOutput:
        """The same outputs, tensors detached from the graph (SMP v1)."""
        return StepOutput([_detached(o) for o in self.outputs])


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
) -> Callable[..., StepOutput]:
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
    def wrapper(*args: Any, **kwargs: Any) -> StepOutput:
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
        return StepOutput(outputs)

    return wrapper


def _detached(obj: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), obj)
