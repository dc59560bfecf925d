"""Cases for test_materialize.py: models built on the meta device by accelerate's init_empty_weights."""

from __future__ import annotations

import math
from typing import Any

import torch

import shardpar as smp
from tests import models

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
    rank, world = smp.rank(), smp.size()
    for step in range(2):
        batch = models.lm_batch(step, 2 * world)
        model.backward(model(**{k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}).loss)
        opt.step()
        opt.zero_grad()
        ref(**batch).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ours, theirs = model.state_dict(), ref.state_dict()
    return {
        "untied_before": untied_before,
        "tied_after": tied_after,
        "c_proj_std": start["transformer.h.0.attn.c_proj.weight"].std().item(),
        "c_proj_expected": cfg.initializer_range / math.sqrt(2 * cfg.n_layer),
        "wte_std": start["transformer.wte.weight"].std().item(),
        "initializer_range": cfg.initializer_range,
        "param": max((ours[k] - theirs[k]).abs().max().item() for k in theirs),
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
