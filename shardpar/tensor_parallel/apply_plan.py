"""Apply a tensor-parallel plan (plans.py) to a model's base: each matching module becomes the TP layer
of its style, built from TP rank 0's full values; then the family's attention attributes count local
heads and its shared-input norms get one copy region for their projections."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from shardpar.sharding.deferred_init import is_deferred, materialize
from shardpar.tensor_parallel.comm import TPComm, copy_to_tp_region
from shardpar.tensor_parallel.layers import (
    ColumnParallelLinear,
    HeadParallelEmbedding,
    RowParallelLinear,
    TPLayer,
    VocabParallelEmbedding,
)
from shardpar.tensor_parallel.plans import Family, pattern_of

Include = Callable[[nn.Module], bool]


def full_value(p: torch.Tensor | None, comm: TPComm) -> torch.Tensor | None:
    """TP rank 0's full value of a parameter (a collective over the TP group; a delayed-initialized one
    is built there, one at a time). Every TP rank then slices the same full tensor, so the TP layers
    hold one model even where the ranks were seeded apart ([Note: rank 0's initial values],
    runtime/initial_values.py)."""
    if p is None:
        return None
    if p.is_meta and not is_deferred(p):
        raise ValueError(
            "tensor parallelism needs parameter values to slice; build the model normally or under "
            "smp.delay_param_initialization(), not on the meta device"
        )
    if comm.rank == 0 or comm.size == 1 or comm.group.handle is None:
        value = materialize(p) if is_deferred(p) else p.detach()
    else:
        value = torch.empty(p.shape, dtype=p.dtype, device="cpu" if p.is_meta else p.device)
    return nn.Parameter(comm.broadcast_from_first(value), requires_grad=p.requires_grad)


def _weight(m: nn.Module, comm: TPComm) -> torch.Tensor:
    w = full_value(getattr(m, "weight", None), comm)
    if w is None:
        raise ValueError(f"{type(m).__name__} has no weight to split")
    return w


def is_conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D"  # transformers.pytorch_utils.Conv1D: weight is [in, out]


def column(linear: Any, comm: TPComm, **kw: Any) -> ColumnParallelLinear:
    w = _weight(linear, comm)
    return ColumnParallelLinear(w, full_value(linear.bias, comm), comm, transposed=is_conv1d(linear), **kw)


def _row(linear: Any, comm: TPComm) -> RowParallelLinear:
    w = _weight(linear, comm)
    return RowParallelLinear(w, full_value(linear.bias, comm), comm, transposed=is_conv1d(linear))


def _is_projection(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or is_conv1d(m)


def _plain(m: nn.Module) -> bool:
    # a subclass with its own forward (a scaled or quantized layer) would lose it in the TP layer
    return type(m).forward in (nn.Linear.forward, nn.Embedding.forward) or is_conv1d(m)


def _check_kind(module: nn.Module, style: str, path: str, embedding: bool = False) -> None:
    ok = isinstance(module, nn.Embedding) if embedding else _is_projection(module)
    if not ok or not _plain(module):
        want = "an nn.Embedding" if embedding else "an nn.Linear or a transformers Conv1D"
        raise TypeError(f"plan style {style!r} of {path} needs {want}; got {type(module).__name__}")


def _build(module: Any, style: str, path: str, comm: TPComm) -> nn.Module | None:
    """The TP layer replacing `module` (None: the module stays, perhaps hooked)."""
    if style in ("colwise", "colwise_rep", "colwise_gather_output", "packed_colwise", "colwise_qkv", "rowwise"):
        _check_kind(module, style, path)
        if style == "rowwise":
            return _row(module, comm)
        parts = {"packed_colwise": 2, "colwise_qkv": 3}.get(style, 1)
        return column(module, comm, num_parts=parts, gather_output=style in ("colwise_rep", "colwise_gather_output"))
    if style == "embedding_rowwise":
        _check_kind(module, style, path, embedding=True)
        return VocabParallelEmbedding(_weight(module, comm), comm, padding_idx=module.padding_idx)
    if style == "embedding_heads":
        _check_kind(module, style, path, embedding=True)
        return HeadParallelEmbedding(_weight(module, comm), comm)
    if style in ("replicated_with_grad_allreduce", "replicate"):
        return None
    raise AssertionError(f"style {style!r} passed check_styles")


def _sum_weight_grads(module: nn.Module, comm: TPComm) -> None:
    """The module's parameters enter its forward through copy_to_tp (identity; backward all-reduces):
    a norm over each head's features sees this rank's heads only, so its gradient is this rank's part
    of the sum over all heads. The parameters keep their names (checkpoints, sharding) and are swapped
    only for the call, so whatever owns them between calls (the sharded engine) sees them unchanged."""
    names = [n for n, _ in module.named_parameters(recurse=False)]
    forward = type(module).forward

    def summed_forward(*args: Any, **kwargs: Any) -> Any:
        params = module._parameters
        kept = {n: params[n] for n in names}
        try:
            for n, p in kept.items():
                if p is not None and p.requires_grad and torch.is_grad_enabled():
                    params[n] = copy_to_tp_region(p, comm)  # type: ignore[assignment]
            return forward(module, *args, **kwargs)
        finally:
            params.update(kept)

    module.forward = summed_forward


def _replace(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(root.get_submodule(parent), leaf, new)


def apply_plan(
    base: nn.Module,
    plan: Mapping[str, str],
    family: Family,
    comm: TPComm,
    include: Include,
    skip: Callable[[nn.Module], bool],
) -> int:
    """Convert `base` (the model's base model) in place by `plan`; `skip(module)` for the modules the
    caller converts itself (the embeddings). Returns how many modules became TP layers."""
    targets = [
        (path, m, plan[pattern_of(path)])
        for path, m in base.named_modules()
        if path and pattern_of(path) in plan and not skip(m) and include(m)
    ]
    converted: dict[str, nn.Module] = {}
    for path, module, style in targets:
        new = _build(module, style, path, comm)
        if new is not None:
            _replace(base, path, new)
            converted[path] = new
    for path, module, style in targets:
        # a per-head norm sees this rank's heads only where its attention's projections were split
        parent = path.rpartition(".")[0]
        if style == "replicated_with_grad_allreduce" and any(p.rpartition(".")[0] == parent for p in converted):
            _sum_weight_grads(module, comm)
    _localize_heads(base, family, converted, comm)
    _share_inputs(base, family, converted, comm)
    return len(converted)


def _localize_heads(base: nn.Module, family: Family, converted: Mapping[str, nn.Module], comm: TPComm) -> None:
    for path, module in base.named_modules():
        attrs = family.local_heads.get(pattern_of(path)) if path else None
        if attrs is None:
            continue
        inside = [p for p in converted if p.startswith(path + ".")]
        if not inside:
            continue
        missed = [n for n, m in module.named_children() if not isinstance(m, TPLayer) and _is_projection(m)]
        if missed:
            raise ValueError(
                f"{path}: some projections are split ({', '.join(p[len(path) + 1 :] for p in inside)}) and some "
                f"not ({', '.join(missed)}); an attention module's projections are split together or not at all. "
                "Mark the whole attention module with smp.tensor_parallelism() / set_tensor_parallelism"
            )
        for attr in attrs:
            setattr(module, attr, getattr(module, attr) // comm.size)


def _copy_output_to_tp(comm: TPComm) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]:
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return copy_to_tp_region(output, comm)

    return hook


def _share_inputs(base: nn.Module, family: Family, converted: Mapping[str, nn.Module], comm: TPComm) -> None:
    """Where every reader of a norm's output was split column-parallel, one copy region on the norm's
    output replaces theirs (same gradients, one all-reduce instead of several)."""
    for path, norm in base.named_modules():
        readers = family.shared_inputs.get(pattern_of(path)) if path else None
        if readers is None:
            continue
        parent = path.rpartition(".")[0]
        layers = [converted.get(f"{parent}.{r}" if parent else r) for r in readers]
        if all(isinstance(m, ColumnParallelLinear) and m.copy_input for m in layers):
            for m in layers:
                m.copy_input = False  # type: ignore[union-attr]
            norm.register_forward_hook(_copy_output_to_tp(comm))
