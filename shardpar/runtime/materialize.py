"""Full values of one parameter at a time, for sharding at wrap time (delayed initialization); the
wrap-time checks of the user's module and the device it is on."""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Iterator
from typing import cast

import torch
from torch import nn

from shardpar.runtime.sharded_tensor import ShardedTensor
from shardpar.sharding.deferred_init import is_deferred, materialize, materialize_by_reset, record_init

_SEED = 0  # every rank materialises a meta parameter with no record from the same RNG state


class Materializer:
    """Full values of one parameter at a time (delayed initialization; see deferred_init.py).

    A parameter recorded under `smp.delay_param_initialization()` is replayed exactly. One that is
    merely on the meta device (accelerate's `init_empty_weights`) gets, inside a Hugging Face
    `PreTrainedModel`, that model's own weight init (see [Note: HF models on meta]); elsewhere its
    module's `reset_parameters()`; both seeded alike on every rank. A real one is used as it is.
    Callers keep their shard and drop the full tensor, so a rank never holds more than one full
    parameter beyond its shards.

    A buffer on the meta device with no record is an error (raised here, while no rank has entered a
    collective): its value (a rotary `inv_freq`, a causal mask) cannot be guessed.
    """

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module = module
        self.device = device
        _check_buffers(module)
        for hf in list(_meta_pretrained_models(module)):
            _init_hf_model(hf)
        self._owner: dict[int, tuple[nn.Module, str]] = {}
        self._reset_values: dict[int, torch.Tensor] = {}
        for m in module.modules():
            for name, p in m.named_parameters(recurse=False):
                self._owner.setdefault(id(p), (m, name))

    def __call__(self, p: nn.Parameter) -> torch.Tensor:
        if is_deferred(p):
            return materialize(p, self.device)
        if p.is_meta:
            if id(p) not in self._reset_values:
                # Reset the owning module's parameters together, while they are all still meta
                # (a module's reset_parameters reads its siblings, e.g. Linear's bias reads the weight).
                owner, _ = self._owner[id(p)]
                for name, q in owner.named_parameters(recurse=False):
                    if q.is_meta and not is_deferred(q):
                        self._reset_values[id(q)] = materialize_by_reset(owner, name, device=self.device, seed=_SEED)
            return self._reset_values.pop(id(p))
        return p.detach()

    def buffers(self) -> None:
        """Buffers are replicated, not sharded: materialise the deferred ones whole, in place."""
        for m in self.module.modules():
            for name, b in list(m._buffers.items()):
                if b is not None and is_deferred(b):
                    m._buffers[name] = materialize(b, self.device)


def check_nothing_materialised(module: nn.Module, *, premade: Collection[nn.Parameter] = ()) -> None:
    """`delayed_parameter_initialization=True` promises no rank builds the full model: every parameter is
    still on meta (deferred or init_empty_weights). `premade` parameters are exempt: the TP layers' (the
    TP conversion, run before this, materialised only this rank's TP slice of them; api/training.py
    passes them in, so the core does not import tensor_parallel). Same outcome on every rank, before any
    collective."""
    exempt = {id(p) for p in premade}
    real = [(n, p.numel()) for n, p in module.named_parameters() if not p.is_meta and id(p) not in exempt]
    if real:
        listed = ", ".join(n for n, _ in real[:3]) + (f" and {len(real) - 3} more" if len(real) > 3 else "")
        raise ValueError(
            f"delayed_parameter_initialization=True, but the module passed to smp.DistributedModel already holds "
            f"{len(real)} initialised parameter(s) ({listed}; {sum(k for _, k in real)} elements), so this rank "
            "built them in full before sharding. Build the model under smp.delay_param_initialization() (or "
            "accelerate's init_empty_weights()) so that each rank materialises only its shards, or set "
            "delayed_parameter_initialization=False to shard a model built normally"
        )


def refuse_nested(module: nn.Module) -> None:
    """A module inside a DistributedModel already (its `.module`, or a part of it) holds sharded
    parameters: wrapping it again would shard pieces of pieces and train on wrong values."""
    for name, p in module.named_parameters():
        if isinstance(p, ShardedTensor):
            raise ValueError(
                f"{type(module).__name__} is already inside a smp.DistributedModel (its parameter {name!r} is "
                "sharded); wrap the plain model once and use that DistributedModel (its .module is the model "
                "itself, to read, not to wrap again)"
            )


def module_device(module: nn.Module) -> torch.device:
    for t in module.parameters():
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def _check_buffers(module: nn.Module) -> None:
    unknown = [n for n, b in module.named_buffers(remove_duplicate=False) if b.is_meta and not is_deferred(b)]
    if unknown:
        listed = ", ".join(unknown[:5]) + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else "")
        raise ValueError(
            f"buffer(s) {listed} are on the meta device with no recorded value (accelerate's "
            "init_empty_weights(include_buffers=True), or torch.device('meta')), so shardpar cannot know "
            "them (a rotary inv_freq, a causal mask) and will not guess; build the model under "
            "smp.delay_param_initialization(), or under init_empty_weights(include_buffers=False) "
            "(its default), which keeps buffers real"
        )


# [Note: HF models on meta]
# Under accelerate's init_empty_weights() an HF model's __init__ runs its weight init on meta
# tensors, which computes nothing, and ties nothing: accelerate re-wraps every parameter it
# registers, so `lm_head.weight = wte.weight` leaves two Parameters. HF itself fixes both after
# loading; we do what its `post_init` would have done: run the model's own `initialize_weights()`
# (every submodule's `_init_weights`, composite sub-models included, e.g. GPT-2's scaled residual
# projections) under shardpar's recorder -- so each parameter is later materialised alone, by replay
# -- then `tie_weights()`. Real tensors (the buffers) are flagged `_is_hf_initialized` meanwhile, the
# flag HF's init functions honour for loaded weights, so they are not rewritten. Only models whose
# parameters are all unrecorded meta tensors are touched; a parameter the init leaves alone falls
# back to its module's reset_parameters().


def _meta_pretrained_models(module: nn.Module) -> Iterator[nn.Module]:
    """The outermost HF PreTrainedModels in `module` whose parameters are all unrecorded meta tensors."""
    modeling = sys.modules.get("transformers.modeling_utils")
    pretrained = getattr(modeling, "PreTrainedModel", None)
    if pretrained is None:
        return
    todo = [module]
    while todo:
        m = todo.pop()
        if not isinstance(m, pretrained):
            todo.extend(m.children())
            continue
        params = list(m.parameters())
        if params and all(p.is_meta and not is_deferred(p) for p in params):
            yield m


def _init_hf_model(hf: nn.Module) -> None:
    """See [Note: HF models on meta]."""
    flagged = [t for t in [*hf.parameters(), *hf.buffers()] if not t.is_meta and not hasattr(t, "_is_hf_initialized")]
    modules = list(hf.modules())
    module_flags = [m.__dict__.pop("_is_hf_initialized", None) for m in modules]  # else HF skips them
    for t in flagged:
        t._is_hf_initialized = True  # type: ignore[attr-defined]
    try:
        record_init(list(hf.parameters()), _hf_init_fn(hf), seed=_SEED)
    finally:
        for t in flagged:
            del t._is_hf_initialized  # type: ignore[attr-defined]
        for m, flag in zip(modules, module_flags, strict=True):
            m.__dict__.pop("_is_hf_initialized", None)
            if flag is not None:
                m._is_hf_initialized = flag
    hf.tie_weights()  # type: ignore[operator]


def _hf_init_fn(hf: nn.Module) -> Callable[[], object]:
    """The model's whole weight init: `initialize_weights` (transformers >= 4.50, which also dispatches
    composite sub-models' own inits), else the root's `_initialize_weights` on every module."""
    whole = getattr(hf, "initialize_weights", None)
    if whole is not None:
        return cast(Callable[[], object], whole)
    per_module = cast(Callable[[nn.Module], None], hf._initialize_weights)
    return lambda: hf.apply(per_module)
