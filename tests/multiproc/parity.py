"""Parity cases (run on every rank by the pool): shardpar training vs a single-process reference.

The reference trains the same model (same seed) on the whole global batch with plain PyTorch:
loss.backward(), clip_grad_norm_, optimizer.step(). Each rank of the distributed run takes its
rdp slice of every micro-batch of that global batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import shardpar as smp
from tests import models

BUILDERS = {
    "mlp": (lambda: _seeded(models.UnevenMLP), models.mlp_batch),
    "neox": (models.tiny_neox, models.lm_batch),
    "gpt2_tied": (models.tiny_gpt2_tied, models.lm_batch),
    # embeddings and LM head as units of their own (sharding/plan.py)
    "neox_wide_vocab": (models.neox_wide_vocab, models.wide_vocab_batch),
}


def _seeded(cls: Any) -> nn.Module:
    torch.manual_seed(0)
    return cls()


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**batch)
    return out if isinstance(out, torch.Tensor) else out.loss


# [Note: Adam eps in parity tests]
# Adam's first update is lr * g / (|g| + eps). Gradients summed in a different order (ReduceScatter
# of micro-step grads vs. one accumulated .grad) differ by fp32 rounding, ~3e-9 absolute on values
# of ~1e-3 (measured on tiny GPT-2). For elements whose gradient is ~1e-7, eps=1e-8 amplifies that to
# ~2.5e-5 in the parameter after one step -- Adam's conditioning, not a sharding error. eps=1e-6
# bounds the amplification 100x lower, so the 1e-5 tolerance checks our arithmetic.
ADAM = {"lr": 1e-2, "eps": 1e-6}


def _param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """HF-style: no weight decay on biases and norms."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith("bias") or "norm" in name or "ln" in name else decay).append(p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def run_parity(
    model_name: str, knobs: dict[str, Any], *, steps: int = 3, accum: int = 1, per_rank: int = 2, clip: float = 0.05
) -> dict[str, Any]:
    """Train both ways; return the max abs differences (losses, params) and whether clipping bit."""
    build, make_batch = BUILDERS[model_name]
    smp.init({**knobs, "sdp_gradient_clipping": clip})
    try:
        rdp_rank, rdp_size = smp.rdp_rank(), smp.rdp_size()
        model = smp.DistributedModel(build(), backward_passes_per_step=accum)
        opt = smp.DistributedOptimizer(torch.optim.AdamW(_param_groups(model), **ADAM))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        ref = build()
        ref_opt = torch.optim.AdamW(_param_groups(ref), **ADAM)
        ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
        loss_diff, clipped = 0.0, False
        for step in range(steps):
            mine, full = [], []
            for micro in range(accum):
                batch = make_batch(1000 * step + micro, per_rank * rdp_size)
                full.append(batch)
                local = {k: v[rdp_rank * per_rank : (rdp_rank + 1) * per_rank] for k, v in batch.items()}
                loss = _loss(model, local)
                model.backward(loss / accum)
                mine.append(loss.item())
            opt.step()
            opt.zero_grad()
            sched.step()
            dist_loss = sum(sum(x) for x in smp.allgather(mine, smp.CommGroup.RDP_GROUP)) / (accum * rdp_size)
            ref_total = 0.0
            for batch in full:
                ref_loss = _loss(ref, batch)
                (ref_loss / accum).backward()
                ref_total += ref_loss.item() / accum
            if clip > 0:  # sdp_gradient_clipping=0 disables clipping
                norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
                clipped |= bool(norm > clip)
            ref_opt.step()
            ref_opt.zero_grad()
            ref_sched.step()
            loss_diff = max(loss_diff, abs(dist_loss - ref_total))
        param_diff = models.max_param_diff(model, ref)
        return {
            "loss": loss_diff,
            "param": param_diff,
            "clipped": float(clipped),
            "sharded_units": float(len(model.units)),
            "unit_names": [u.name for u in model.units],
            "all_sharded": float(model.all_sharded()),
            # sharded elements the optimizer steps against the shards' (shard_optimizer_state: 1/replicas)
            "stepped_numel": float(sum(p.length for p in model.sharded_state.pieces if p.sharded)),
            "shard_numel": float(sum(u.layout.shard_numel for u in model.units)),
        }
    finally:
        smp.shutdown()


def run_many(cases: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    """Several parity cases in one spawn (each re-inits shardpar)."""
    return [run_parity(name, knobs, **kw) for name, knobs, kw in cases]
