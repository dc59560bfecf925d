"""The `smp` facade, training half: step, register_parameter, tensor_parallelism, model_creation,
delay_param_initialization and checkpoints (DistributedModel and DistributedOptimizer, classes, are in
wrappers.py). The process-wide state these read and fill lives in context.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardpar import checkpoint as _checkpoint
from shardpar.api.context import _REGISTERED, _TP_MARKS, state
from shardpar.api.step import StepOptions, make_step
from shardpar.checkpoint import async_save as _async_save
from shardpar.checkpoint.torch_file import load_torch_file
from shardpar.optim.optimizer import DistributedOptimizer as _DistributedOptimizer
from shardpar.runtime.model import DistributedModel as _DistributedModel
from shardpar.sharding.deferred_init import deferred_init
from shardpar.tensor_parallel.marks import TPOptions
from shardpar.v1_notes import note_once

# ---- model, optimizer, step ----------------------------------------------------------------------


def register_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Make `param` (owned by another module) available, gathered, during `module`'s forward."""
    if not isinstance(param, nn.Parameter):
        raise TypeError(f"register_parameter needs an nn.Parameter, got {type(param).__name__}")
    params = _REGISTERED.setdefault(module, [])
    if all(p is not param for p in params):
        params.append(param)


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


# v1's model_creation options whose v1 meaning cannot apply here: what happens instead, logged once.
_V1_CREATION_NOTES = {
    "zero_init": "parameters are sharded when smp.DistributedModel wraps the model (v1 partitioned them at creation "
    "with DeepSpeed's zero.Init); set delayed_parameter_initialization=True to create no parameter memory before",
    "distribute_embedding": "under tensor parallelism the embeddings and LM head are always split over the TP group "
    "(docs/tensor_parallelism.md); otherwise they are sharded like every other parameter",
    "use_alibi": "not applied: the Hugging Face model keeps its own position encoding (ALiBi was an option of v1's "
    "DistributedTransformer, which shardpar does not have); choose a model whose config uses ALiBi instead",
    "fp32_residual_addition": "not applied: the residual additions run in the compute dtype, as the Hugging Face "
    "modules are written (an option of v1's DistributedTransformer)",
    "flash_attention": "nothing to switch: Hugging Face attention calls torch's scaled_dot_product_attention, which "
    "runs a flash kernel where the device has one",
}


@contextlib.contextmanager
def model_creation(
    tensor_parallelism: bool = False, dtype: torch.dtype | None = None, **tensor_parallel_config: Any
) -> Iterator[None]:
    """SMP v1's one context for building a model: `smp.tensor_parallelism(tensor_parallelism)`, the
    model created in `dtype` (default: torch's default dtype), and -- when the config sets
    `delayed_parameter_initialization` -- `smp.delay_param_initialization()`, so no parameter memory
    is made. `vocab_parallel_loss=` is passed on to tensor parallelism; v1's kernel switches
    (`attention_in_fp32`, `fused_*`, ...) are accepted and change nothing (see migration.md), and v1's
    `zero_init`, `distribute_embedding`, `use_alibi`, `fp32_residual_addition` and `flash_attention`
    are accepted with one rank-0 log line saying what happens here instead (_V1_CREATION_NOTES)."""
    for name in set(tensor_parallel_config) & set(_V1_CREATION_NOTES):
        value = tensor_parallel_config.pop(name)
        if not isinstance(value, bool):
            raise TypeError(f"smp.model_creation({name}={value!r}): pass True or False, as in SageMaker v1")
        if value:
            note_once(f"smp.model_creation({name}=True)", _V1_CREATION_NOTES[name])
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
    `non_split_inputs`, and return the function's structure (tuples, lists, dicts, nested) with a
    StepOutput of the micro-batches' values in each place, as SMP v1 did."""
    options = StepOptions(
        non_split_inputs=tuple(non_split_inputs or ()),
        input_split_axes=dict(input_split_axes or {}),
        detach_outputs=detach_outputs,
    )

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
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
    fix = "Call smp.save_checkpoint on every rank: every rank writes its shard (or gathers for rank 0's files)."
    with model.gathering("smp.save_checkpoint()", fix):
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
    With `partial=False`, a file (`path/tag`, or `path` without a tag) is read as SMP v1's `fullmodel.pt`:
    a `torch.save`d state dict, loaded weights-only into the model (checkpoint/torch_file.py).
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
    file = Path(path) / tag if tag is not None else Path(path)
    if file.is_file():  # SMP v1's --fine_tune: a torch.save of the full state dict
        if partial:
            raise ValueError(
                f"smp.resume_from_checkpoint({str(path)!r}, tag={tag!r}): {file} is a file, and a partial checkpoint "
                "is a directory written by smp.save_checkpoint; to load a full model saved with torch.save (SMP "
                "v1's fullmodel.pt), pass partial=False"
            )
        load_torch_file(file, st.model, strict)
        return None
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
