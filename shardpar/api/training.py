"""The `smp` facade, training half: DistributedModel, DistributedOptimizer, step, register_parameter,
tensor_parallelism, delay_param_initialization and checkpoints. The process-wide state these read
and fill lives in context.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from shardpar import checkpoint as _checkpoint
from shardpar.api.context import _REGISTERED, _TP_MARKS, state
from shardpar.api.same_model import check_same_model
from shardpar.api.step import StepOptions, StepOutput, make_step
from shardpar.checkpoint import async_save as _async_save
from shardpar.optim.loss_scaling import make_loss_scaler
from shardpar.optim.optimizer import DistributedOptimizer as _DistributedOptimizer
from shardpar.runtime.materialize import refuse_nested
from shardpar.runtime.model import DistributedModel as _DistributedModel
from shardpar.sharding.deferred_init import deferred_init
from shardpar.sharding.plan import WrapPolicy
from shardpar.tensor_parallel.layers import TPLayer, tp_split_table
from shardpar.tensor_parallel.marks import TPOptions
from shardpar.tensor_parallel.marks import prepare_model as prepare_tensor_parallel

# ---- model, optimizer, step ----------------------------------------------------------------------


def register_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Make `param` (owned by another module) available, gathered, during `module`'s forward."""
    if not isinstance(param, nn.Parameter):
        raise TypeError(f"register_parameter needs an nn.Parameter, got {type(param).__name__}")
    params = _REGISTERED.setdefault(module, [])
    if all(p is not param for p in params):
        params.append(param)


# SMP v1's DistributedModel arguments that tuned its tracer or its DDP wrapper: accepted with their v1
# types, changing nothing here (there is no tracer, and shardpar's reducer is not DDP's).
_V1_MODEL_ARGS: dict[str, tuple[tuple[type, ...], str]] = {
    "trace_device": ((str,), "'cpu' or 'gpu'"),
    "trace_execution_times": ((bool,), "true or false"),
    "trace_memory_usage": ((bool,), "true or false"),
    "overlapping_allreduce": ((bool,), "true or false"),
    "bucket_cap_mb": ((int, float), "a number of MB > 0"),
    "gradient_as_bucket_view": ((bool,), "true or false"),
}


def _check_v1_model_args(args: dict[str, Any]) -> None:
    for name, value in args.items():
        if name not in _V1_MODEL_ARGS:
            raise TypeError(
                f"smp.DistributedModel got an unexpected keyword argument {name!r}; it takes backward_passes_per_step, "
                f"wrap, tensor_parallelism, average_grads_across_microbatches, broadcast_buffers and v1's "
                f"{sorted(_V1_MODEL_ARGS)}"
            )
        types, valid = _V1_MODEL_ARGS[name]
        ok = isinstance(value, types) and (not isinstance(value, bool) or bool in types)
        ok = ok and (name != "trace_device" or value in ("cpu", "gpu")) and (name != "bucket_cap_mb" or value > 0)
        if not ok:
            raise ValueError(f"smp.DistributedModel({name}={value!r}): must be {valid}, as in SageMaker v1")


def DistributedModel(
    module: nn.Module,
    *,
    backward_passes_per_step: int = 1,
    wrap: WrapPolicy = None,
    tensor_parallelism: bool = False,
    average_grads_across_microbatches: bool = True,
    broadcast_buffers: bool = True,
    **v1_args: Any,
) -> _DistributedModel:
    """Shard `module` over the sharding group (reference 003); returns the wrapped model.

    With `tensor_parallelism=True`, or for a model built under `smp.tensor_parallelism()`, the Hugging
    Face model's blocks and embeddings are first split in place over the TP group; each TP rank then
    shards its local parameters inside its sharding group (docs/tensor_parallelism.md).
    `average_grads_across_microbatches=False` sums the micro-batches' gradients under `@smp.step`
    (SMP v1; for a loss that sums over samples). `broadcast_buffers` (SMP v1 / DDP): rank 0's buffers
    reach every data-parallel rank at wrapping and before each forward that records a graph
    (runtime/buffers.py); False leaves each rank's own. SMP v1's tracer and DDP arguments
    (`trace_device`, `overlapping_allreduce`, `bucket_cap_mb`, ...) are accepted and change nothing.
    """
    if not isinstance(broadcast_buffers, bool):
        raise ValueError(f"smp.DistributedModel(broadcast_buffers={broadcast_buffers!r}): must be True or False")
    _check_v1_model_args(v1_args)
    if not isinstance(average_grads_across_microbatches, bool):
        raise ValueError(
            f"average_grads_across_microbatches={average_grads_across_microbatches!r} must be True or False"
        )
    st = state()
    if isinstance(module, _DistributedModel):
        raise ValueError("the module is already a DistributedModel; wrap the plain module once")
    refuse_nested(module)  # before any collective reads its (sharded) parameters
    check_same_model(module, st.topology.group("world"))
    module = prepare_tensor_parallel(
        module,
        requested=tensor_parallelism,
        marks=_TP_MARKS,
        topology=st.topology,
        engine=st.engine,
    )
    registered = {id(m): list(ps) for m, ps in _REGISTERED.items()}
    model = _DistributedModel(
        module.to(st.device) if not _has_meta_tensors(module) else module,
        config=st.config,
        topology=st.topology,
        engine=st.engine,
        backward_passes_per_step=backward_passes_per_step,
        wrap=wrap,
        registered=registered,
        device=st.device,
        premade=[p for m in module.modules() if isinstance(m, TPLayer) for p in m.parameters()],
        average_grads_across_microbatches=average_grads_across_microbatches,
        find_optimizer=lambda: st.optimizer,
        tp_splits=tp_split_table(module) if st.topology.tp.size > 1 else None,
        broadcast_buffers=broadcast_buffers,
    )
    st.model = model
    return model


def _has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def tensor_parallelism(
    enabled: bool = True, *, vocab_parallel_loss: bool = False, **v1_kernel_switches: Any
) -> AbstractContextManager[None]:
    """Modules built inside are split over the TP group when `smp.DistributedModel` wraps them
    (GPT-NeoX, Llama, GPT-2); nest `enabled=False` to keep a part replicated. `vocab_parallel_loss`:
    the LM head returns this rank's vocabulary slice of the logits and the model's loss is the
    vocab-parallel cross-entropy (otherwise the logits are all-gathered). SMP v1's kernel switches
    (`fused_softmax`, `fused_bias_gelu`, ...) are accepted and change nothing (migration.md)."""
    _check_kernel_switches("smp.tensor_parallelism", v1_kernel_switches)
    return _TP_MARKS.building(TPOptions(enabled=enabled, vocab_parallel_loss=vocab_parallel_loss))


def set_tensor_parallelism(
    module: nn.Module, enabled: bool = True, *, vocab_parallel_loss: bool = False, **v1_kernel_switches: Any
) -> None:
    """SMP v1: turn tensor parallelism on or off for a model already built, before `smp.DistributedModel`
    wraps it -- the same marks `smp.tensor_parallelism()` gives modules built inside it. Enabling
    splits the supported blocks under `module` (except parts switched off); disabling keeps all of
    `module` replicated."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"smp.set_tensor_parallelism needs an nn.Module, got {type(module).__name__}")
    if not isinstance(enabled, bool):
        raise TypeError(f"smp.set_tensor_parallelism(enabled={enabled!r}): pass True or False")
    _check_kernel_switches("smp.set_tensor_parallelism", v1_kernel_switches)
    _TP_MARKS.set(module, TPOptions(enabled=enabled, vocab_parallel_loss=vocab_parallel_loss))


def delay_param_initialization(enabled: bool = True) -> AbstractContextManager[None]:
    """Build a model inside this context to create no parameter memory: each rank later materialises
    only its shards (one full parameter at a time), with the values a normal init would give.
    `enabled=False` (SMP v1's signature) builds the model normally."""
    return deferred_init() if enabled else contextlib.nullcontext()


# v1's tensor-parallel config keywords (for DistributedTransformer) that choose kernels, not results:
# accepted, and documented in migration.md. HF attention already computes its softmax in fp32.
_V1_KERNEL_SWITCHES = {
    "attention_in_fp32",
    "query_key_layer_scaling",
    "fused_softmax",
    "fused_bias_gelu",
    "fused_dropout",
    "fused_bias_dropout",
    "fused_layernorm",
}


def _check_kernel_switches(where: str, switches: Mapping[str, Any]) -> None:
    unknown = set(switches) - _V1_KERNEL_SWITCHES
    if unknown:
        raise TypeError(
            f"{where} got unknown keyword(s) {sorted(unknown)}; besides its own arguments it takes "
            f"vocab_parallel_loss and v1's kernel switches {sorted(_V1_KERNEL_SWITCHES)}"
        )


@contextlib.contextmanager
def model_creation(
    tensor_parallelism: bool = False, dtype: torch.dtype | None = None, **tensor_parallel_config: Any
) -> Iterator[None]:
    """SMP v1's one context for building a model: `smp.tensor_parallelism(tensor_parallelism)`, the
    model created in `dtype` (default: torch's default dtype), and -- when the config sets
    `delayed_parameter_initialization` -- `smp.delay_param_initialization()`, so no parameter memory
    is made. `vocab_parallel_loss=` is passed on to tensor parallelism; v1's kernel switches
    (`attention_in_fp32`, `fused_*`, ...) are accepted and change nothing (see migration.md)."""
    _check_kernel_switches(
        "smp.model_creation", {k: v for k, v in tensor_parallel_config.items() if k != "vocab_parallel_loss"}
    )
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(
            f"smp.model_creation(dtype={dtype!r}): pass a floating-point torch.dtype such as torch.bfloat16"
        )
    vocab_parallel = bool(tensor_parallel_config.get("vocab_parallel_loss", False))
    delay = state().config.delayed_parameter_initialization
    previous = torch.get_default_dtype()
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            _TP_MARKS.building(TPOptions(enabled=tensor_parallelism, vocab_parallel_loss=vocab_parallel))
        )
        if delay:
            stack.enter_context(deferred_init())
        if dtype is not None:
            torch.set_default_dtype(dtype)
            stack.callback(torch.set_default_dtype, previous)
        yield


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    static_loss_scale: float | None = 1.0,
    dynamic_loss_scale: bool = False,
    dynamic_loss_args: dict[str, Any] | None = None,
    *,
    model: _DistributedModel | None = None,
) -> _DistributedOptimizer:
    """Re-point `optimizer` at the local main shards. Clipping (sdp_gradient_clipping) and, with fp16,
    loss scaling run inside step(): static, or dynamic with `dynamic_loss_args` keys init_scale,
    scale_factor, scale_window, min_scale, delayed_shift, consecutive_hysteresis."""
    st = state()
    model = model or st.model
    if model is None:
        raise ValueError("smp.DistributedOptimizer needs a model: call smp.DistributedModel(model) first")
    scaler = make_loss_scaler(
        model.policy,
        static_loss_scale=static_loss_scale,
        dynamic_loss_scale=dynamic_loss_scale,
        dynamic_loss_args=dynamic_loss_args,
    )
    splits = tp_split_table(model.module) if model.topology.tp.size > 1 else None  # the grad norm's TP rule
    opt = _DistributedOptimizer(
        optimizer, model, clip_norm=st.config.sdp_gradient_clipping, loss_scaler=scaler, tp_splits=splits
    )
    st.optimizer = opt
    return opt


def step(
    fn: Callable[..., Any] | None = None,
    *,
    non_split_inputs: list[str] | tuple[str, ...] | None = None,
    input_split_axes: Mapping[str, int] | None = None,
    detach_outputs: bool = True,
) -> Any:
    """Decorator, `@smp.step` or SMP v1's `@smp.step(non_split_inputs=..., input_split_axes=...,
    detach_outputs=True)`: run the function once per micro-batch (config `microbatches`), splitting
    every argument on its batch axis (0 unless `input_split_axes` names another) except modules and
    `non_split_inputs`, and return a StepOutput."""
    options = StepOptions(
        non_split_inputs=tuple(non_split_inputs or ()),
        input_split_axes=dict(input_split_axes or {}),
        detach_outputs=detach_outputs,
    )

    def decorate(f: Callable[..., Any]) -> Callable[..., StepOutput]:
        if not callable(f):
            raise TypeError(f"@smp.step decorates a function, got {f!r}")
        return make_step(
            f,
            find_model=lambda: state().model,
            microbatches=lambda: state().config.microbatches,
            options=options,
        )

    return decorate if fn is None else decorate(fn)


# ---- checkpoints ---------------------------------------------------------------------------------


def save_checkpoint(
    path: str | os.PathLike[str],
    tag: str,
    partial: bool = True,
    model: _DistributedModel | None = None,
    optimizer: _DistributedOptimizer | None = None,
    user_content: Any = None,
    translate_if_full: bool = True,
    num_kept_partial_checkpoints: int | None = None,
    *,
    max_shard_size: int | None = None,
    full_dtype: torch.dtype | None = None,
    async_save: bool = False,
) -> None:
    """SMP v1 semantics: `partial=True` writes each shard once (replica 0), resumable under another
    topology; `partial=False` writes a Hugging Face directory, split into files of at most
    `max_shard_size` bytes and cast to `full_dtype` (default fp32) when given. Without `optimizer`
    the last smp.DistributedOptimizer is saved when it was built over `model`. Atomic: `newest`
    moves last. `async_save=True` (partial) returns once this rank's state is copied to host memory;
    `smp.wait_for_checkpoint()`, `smp.poll_checkpoint()`, the next save or a resume commits it."""
    st = state()
    model = model or st.model
    if model is None:
        raise ValueError("smp.save_checkpoint needs a model: call smp.DistributedModel(model) first")
    if partial:
        for name, value in (("max_shard_size", max_shard_size), ("full_dtype", full_dtype)):
            if value is not None:
                raise ValueError(
                    f"smp.save_checkpoint({name}={value}) applies to the Hugging Face export only: "
                    f"pass partial=False with it, or drop {name} (a partial checkpoint keeps one fp32 file per rank)"
                )
    if optimizer is not None and optimizer.model is not model:
        raise ValueError(
            "smp.save_checkpoint: the optimizer was built over another DistributedModel than `model`; "
            "pass the optimizer of this model (or none)"
        )
    _checkpoint.save_checkpoint(
        path,
        tag,
        model=model,
        optimizer=optimizer or _optimizer_of(model),
        topology=st.topology,
        engine=st.engine,
        partial=partial,
        user_content=user_content,
        translate_if_full=translate_if_full,
        num_kept_partial_checkpoints=num_kept_partial_checkpoints,
        max_shard_size=max_shard_size,
        full_dtype=full_dtype,
        async_save=async_save,
    )


def wait_for_checkpoint(timeout_s: float | None = None) -> str | None:
    """Collective: wait for the pending async save's writers and commit it (`newest` moves); its directory,
    or None when none is pending. A failed write raises on every rank; `newest` stays where it was."""
    final = _async_save.finish(timeout_s)
    return str(final) if final is not None else None


def poll_checkpoint() -> bool:
    """Collective, at the same point of every rank's loop (e.g. after `optimizer.step()`): commit the pending
    async save if every rank finished writing it (one small all-gather while one is pending, none
    otherwise). True when no async save is pending any more."""
    return _async_save.poll()


def _optimizer_of(model: _DistributedModel) -> _DistributedOptimizer | None:
    """The last smp.DistributedOptimizer when it steps `model`'s shards; else None (never another model's)."""
    opt = state().optimizer
    return opt if opt is not None and opt.model is model else None


def resume_from_checkpoint(
    path: str | os.PathLike[str],
    tag: str | None = None,
    partial: bool = True,
    strict: bool = True,
    load_optimizer: bool = True,
    load_sharded_optimizer_state: bool = True,
    translate_function: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Any:
    """Load the checkpoint `tag` (None: the newest) into the model and optimizer built before this
    call, resharding when the topology changed; returns the saved user_content. A re-save that
    crashed between its two renames is undone first ([Note: re-saving a tag] in checkpoint/atomic.py).
    SMP v1's `load_sharded_optimizer_state` and `translate_function` are accepted at their defaults."""
    if load_sharded_optimizer_state is not True:
        raise ValueError(
            f"resume_from_checkpoint(load_sharded_optimizer_state={load_sharded_optimizer_state!r}): loading the "
            "main parameters and loss scale without the optimizer's own state is not provided; pass "
            "load_optimizer=False to load the model alone"
        )
    if translate_function is not None:
        raise ValueError(
            "resume_from_checkpoint(translate_function=...): shardpar's full checkpoints keep the model's own "
            "(Hugging Face) parameter names, so there is nothing to translate; to load a state dict in another "
            "naming, translate it yourself and call model.load_state_dict(...)"
        )
    st = state()
    if st.model is None:
        raise ValueError("smp.resume_from_checkpoint needs the DistributedModel (and optimizer) built first")
    return _checkpoint.resume_from_checkpoint(
        path,
        tag,
        model=st.model,
        optimizer=_optimizer_of(st.model),
        topology=st.topology,
        engine=st.engine,
        partial=partial,
        strict=strict,
        load_optimizer=load_optimizer,
    )
