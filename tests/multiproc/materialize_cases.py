"""Cases for test_materialize.py: models built on the meta device by accelerate's init_empty_weights."""

from __future__ import annotations

import math
from typing import Any

import torch

import shardpar as smp
from tests import memory, models

SHARD = {"sdp_param_persistence_threshold": 10, "sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0.0}


def _empty_weights(build: Any, **kwargs: Any) -> torch.nn.Module:
    from accelerate import init_empty_weights

    with init_empty_weights(**kwargs):
        module: torch.nn.Module = build()
    return module


def hf_init_case() -> dict[str, Any]:
    """A tiny GPT-NeoX under init_empty_weights gets HF's _init_weights (normal(0, initializer_range)
    weights, zero biases, unit norms), the same on every rank, not torch's module defaults."""
    smp.init(SHARD)
    module = _empty_weights(models.tiny_neox)
    std = module.config.initializer_range
    model = smp.DistributedModel(module)
    full = model.state_dict()
    weights = [k for k in full if k.endswith(".weight") and "layernorm" not in k and "layer_norm" not in k]
    norms = [k for k in full if ("layernorm" in k or "layer_norm" in k) and k.endswith(".weight")]
    biases = [k for k in full if k.endswith(".bias")]
    checksum = float(sum(v.double().sum() for v in full.values()))
    loss = model(**models.lm_batch(0, 2)).loss
    return {
        "initializer_range": std,
        "embed_std": full["gpt_neox.embed_in.weight"].std().item(),
        "weight_stds": {k: full[k].std().item() for k in weights},
        "norms_one": all(torch.equal(full[k], torch.ones_like(full[k])) for k in norms) and bool(norms),
        "biases_zero": all(not full[k].any() for k in biases) and bool(biases),
        "same_on_ranks": len(set(smp.allgather(checksum))) == 1,
        "loss": loss.item(),
        "log_vocab": math.log(module.config.vocab_size),
    }


def gpt2_tied_case() -> dict[str, Any]:
    """GPT-2 under init_empty_weights: accelerate unties lm_head from wte; wrapping re-ties them, gives
    the residual projections HF's scaled init (Conv1D has no reset_parameters), and trains exactly
    like a normally built GPT-2 loaded with the same values."""
    smp.init(SHARD)
    module = _empty_weights(models.tiny_gpt2_tied)
    untied_before = module.lm_head.weight is not module.transformer.wte.weight
    model = smp.DistributedModel(module)
    tied_after = module.lm_head.weight is module.transformer.wte.weight
    cfg = module.config
    start = model.state_dict()
    ref = models.tiny_gpt2_tied()
    ref.load_state_dict(start)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    param_diff = models.train_lm_side_by_side(model, opt, ref, ref_opt, rank=smp.rank(), world=smp.size())
    return {
        "untied_before": untied_before,
        "tied_after": tied_after,
        "c_proj_std": start["transformer.h.0.attn.c_proj.weight"].std().item(),
        "c_proj_expected": cfg.initializer_range / math.sqrt(2 * cfg.n_layer),
        "wte_std": start["transformer.wte.weight"].std().item(),
        "initializer_range": cfg.initializer_range,
        "param": param_diff,
    }


def meta_buffer_case() -> dict[str, Any]:
    """init_empty_weights(include_buffers=True) leaves rotary inv_freq on meta: a ValueError on every
    rank before any collective (the group still works afterwards); the default keeps buffers real."""
    smp.init(SHARD)
    module = _empty_weights(models.tiny_neox, include_buffers=True)
    try:
        smp.DistributedModel(module)
        error = ""
    except ValueError as e:
        error = str(e)
    alive = smp.allgather(smp.rank()) == list(range(smp.size()))
    fine = smp.DistributedModel(_empty_weights(models.tiny_neox))
    real = models.tiny_neox()
    inv_freq = real.gpt_neox.rotary_emb.inv_freq
    return {
        "error": error,
        "alive": alive,
        "default_inv_freq_ok": torch.equal(fine.module.gpt_neox.rotary_emb.inv_freq, inv_freq),
    }


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def construction_peak_case(how: str) -> dict[str, Any]:
    """Peak bytes of the storages created while `smp.DistributedModel` shards a model that holds no
    parameter memory yet: built under smp.delay_param_initialization() ("deferred"), or on the meta
    device by accelerate's init_empty_weights ("meta", which gets HF's own init, replayed per tensor).
    The issue: "no rank ever holds more than its shards plus one full parameter"."""
    smp.init(SHARD)
    if how == "deferred":
        with smp.delay_param_initialization():
            module = models.tiny_neox(seed=3)
    else:
        module = _empty_weights(models.tiny_neox)
    params = list(module.parameters())
    if not all(p.is_meta for p in params):
        raise AssertionError(f"{how}: the model holds real parameters before wrapping")
    largest, full_model = max(_nbytes([p]) for p in params), _nbytes(params)
    real_buffers_before = {id(b) for b in module.buffers() if not b.is_meta}
    with memory.LiveBytes() as building:
        model = smp.DistributedModel(module)
    kept = [u.main_shard for u in model.units] + [model.persistent.main, model.persistent.compute]
    kept += [u._compute_shard for u in model.units if u._compute_shard is not None]
    # Buffers are replicated, not sharded: a deferred one is materialised whole and kept (8 B here:
    # the rotary inv_freq and original_inv_freq); real ones existed before and are not counted.
    made_buffers = [b for b in module.buffers() if id(b) not in real_buffers_before]
    return {
        "peak": building.peak,
        "live_after": building.live,
        "shards": memory.total_bytes(memory.storages_of(kept)),
        "largest_param": largest,
        "full_model": full_model,
        "made_buffers": _nbytes(made_buffers),
    }


def _wrap_error(build: Any) -> str:
    try:
        smp.DistributedModel(build())
    except ValueError as e:
        return str(e)
    return ""


def delayed_knob_case() -> dict[str, Any]:
    """delayed_parameter_initialization=True: a model built normally is a ValueError on every rank (the
    group stays usable); one built under smp.delay_param_initialization() or init_empty_weights is
    wrapped; so is a tensor-parallel one, whose TP layers the conversion materialised (tp 2)."""

    def deferred() -> torch.nn.Module:
        with smp.delay_param_initialization():
            return models.tiny_neox()

    smp.init({**SHARD, "delayed_parameter_initialization": True})
    out = {
        "real": _wrap_error(models.tiny_neox),
        "alive": smp.allgather(smp.rank()) == list(range(smp.size())),
        "deferred": _wrap_error(deferred),
        "meta": _wrap_error(lambda: _empty_weights(models.tiny_neox)),
    }
    smp.shutdown()
    smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True, "delayed_parameter_initialization": True})

    def deferred_tp() -> torch.nn.Module:
        with smp.tensor_parallelism():
            return deferred()

    out["tp"] = _wrap_error(deferred_tp)
    smp.shutdown()
    smp.init({**SHARD, "delayed_parameter_initialization": False})
    out["knob_off"] = _wrap_error(models.tiny_neox)
    return out
