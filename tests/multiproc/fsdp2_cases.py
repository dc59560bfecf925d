"""Cases for test_fsdp2_idioms.py (issue 29 item 6): FSDP2's idioms on a wrapped model against one
process in the same state. World 2, sdp 2; weights sharded, the 32-element biases and norms persistent.

Exactness: both sides get the same gradients, set on `.grad` (not computed from split batches, whose
summation order differs), and step AdamW on them element by element -- so the parameters and the
optimizer state are the same bits on both sides, and every comparison below is `torch.equal`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)

import shardpar as smp
from shardpar.runtime.sharded_tensor import ShardedTensor
from tests import models

CONFIG = {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 40, "sdp_gradient_clipping": 0.0}


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two param groups (weight decay on matrices only): FQNs must come out per group."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(_groups(model), lr=1e-2, eps=1e-6)


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """The same full gradient for every parameter on both sides, then a step."""
    g = torch.Generator().manual_seed(seed)
    for _, p in sorted(model.named_parameters()):
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    opt.zero_grad()


def _detached(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def _same(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two (nested) state dicts differ: keys, types, tensors bit for bit, other values by ==."""
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b) and set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, set(a) ^ set(b)))[:4]}"]
        return [d for k in a for d in _same(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _same(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        ok = type(a) is type(b) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        return [] if ok else [f"{where}: {type(a).__name__}{list(a.shape)} vs {type(b).__name__}{list(b.shape)}"]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def gathered(value: Any) -> Any:
    """A (nested) state dict with every ShardedTensor replaced by its `full_tensor()` (a collective per
    tensor; every rank walks the same dict in the same order)."""
    if isinstance(value, ShardedTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: gathered(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(gathered(v) for v in value)
    return value


def state_dict_functions_case() -> dict[str, Any]:
    smp.init(dict(CONFIG))
    out: dict[str, Any] = {}
    ref = models.tiny_neox(0)
    ref_opt = _adamw(ref)
    model = smp.DistributedModel(models.tiny_neox(0))
    opt = smp.DistributedOptimizer(_adamw(model))
    for seed in (1, 2):
        _step(ref, ref_opt, seed)
        _step(model, opt, seed)
    out["sharded"] = sorted({type(p).__name__ for p in model.parameters()})
    # p.full_tensor(): DTensor's, a plain tensor with every rank's values
    fulls = {n: p.full_tensor() for n, p in model.named_parameters()}
    out["full_tensor"] = _same(fulls, _detached(ref))
    out["full_tensor_type"] = sorted({type(t).__name__ for t in fulls.values()})
    # torch.distributed.checkpoint.state_dict: what the same calls give for one process
    for name, options in (
        ("default", None),
        ("full", StateDictOptions(full_state_dict=True)),
        ("full_cpu", StateDictOptions(full_state_dict=True, cpu_offload=True)),  # rank 0 only, as torch
        ("flat", StateDictOptions(flatten_optimizer_state_dict=True)),
        ("frozen", StateDictOptions(ignore_frozen_params=True)),
    ):
        ours = get_state_dict(model, opt, options=options)
        theirs = get_state_dict(ref, ref_opt, options=options)
        # without full_state_dict, FSDP2's default, the parameters come sharded (as FSDP2's DTensors)
        out[f"{name}_types"] = sorted({type(v).__name__ for v in ours[0].values()})
        out[name] = _same(gathered(ours), theirs)
        out[f"{name}_sizes"] = (len(ours[0]), len(ours[1]))
    out["model_only"] = _same(gathered(get_model_state_dict(model)), get_model_state_dict(ref))
    # a plain torch optimizer over model.parameters() (it steps the ShardedTensors themselves)
    plain = smp.DistributedModel(models.tiny_neox(0))
    plain_opt = _adamw(plain)
    for seed in (1, 2):
        _step(plain, plain_opt, seed)
    out["plain_optimizer"] = _same(gathered(get_state_dict(plain, plain_opt)), get_state_dict(ref, ref_opt))
    out["optim_only"] = _same(gathered(get_optimizer_state_dict(model, opt)), get_optimizer_state_dict(ref, ref_opt))
    # set_state_dict: one process's state dicts into a fresh model and optimizer (another init), then
    # one more step on each side: the same parameters, so the loaded Adam moments and steps were used
    model_sd, optim_sd = get_state_dict(ref, ref_opt)
    fresh = smp.DistributedModel(models.tiny_neox(1))
    fresh_opt = smp.DistributedOptimizer(_adamw(fresh))
    set_state_dict(fresh, fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    out["loaded"] = _same(gathered(get_state_dict(fresh, fresh_opt)), get_state_dict(ref, ref_opt))
    flat_sd = get_optimizer_state_dict(ref, ref_opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    flat_fresh = smp.DistributedModel(models.tiny_neox(1))
    flat_opt = smp.DistributedOptimizer(_adamw(flat_fresh))
    set_state_dict(flat_fresh, flat_opt, model_state_dict=model_sd, optim_state_dict=flat_sd)
    out["loaded_flat"] = _same(gathered(get_optimizer_state_dict(flat_fresh, flat_opt)), optim_sd)
    _step(ref, ref_opt, 3)
    _step(fresh, fresh_opt, 3)
    out["stepped_after_load"] = _same(gathered(get_state_dict(fresh, fresh_opt)), get_state_dict(ref, ref_opt))
    try:
        get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        out["broadcast"] = "no error"
    except ValueError as e:
        out["broadcast"] = str(e)
    return out


def unshard_case() -> dict[str, Any]:
    """model.unshard() / reshard() with FSDP2's semantics; the gathered parameters are the model's."""
    smp.init(dict(CONFIG))
    ref = models.tiny_neox(0)
    model = smp.DistributedModel(models.tiny_neox(0))
    probe = models.lm_batch(5, 2)["input_ids"]
    out: dict[str, Any] = {}
    with torch.no_grad():
        want = model(input_ids=probe).logits

    def held() -> list[str]:
        return sorted({"sharded" if isinstance(p, ShardedTensor) else "whole" for p in model.module.parameters()})

    out["before"] = (held(), model.all_sharded())
    assert model.unshard() is None
    out["unsharded"] = (held(), model.all_sharded())
    out["values"] = _same(_detached(model.module), _detached(ref))
    with torch.no_grad():
        out["logits"] = (model(input_ids=probe).logits - want).abs().max().item()
    out["after_forward"] = (held(), model.all_sharded())  # the next forward resharded each unit after use
    handle = model.unshard(async_op=True)
    assert handle is not None
    handle.wait()
    out["async"] = (held(), model.all_sharded())
    model.reshard()
    out["resharded"] = (held(), model.all_sharded())
    # a training forward and backward after unshard(): the same loss as without, every unit freed after
    want_loss = model(input_ids=probe, labels=probe).loss
    want_loss.backward()
    model.zero_grad()
    model.unshard()
    loss = model(input_ids=probe, labels=probe).loss
    loss.backward()
    out["train_loss"] = (loss - want_loss).abs().item()
    out["after_backward"] = (held(), model.all_sharded(), all(p.grad is not None for p in model.parameters()))
    return out
