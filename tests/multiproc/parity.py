"""Parity cases (run on every rank by the pool): shardpar training vs a single-process reference.

The reference trains the same model (same seed) on the whole global batch with plain PyTorch:
loss.backward(), clip_grad_norm_, optimizer.step(); rank 0 runs it and every rank compares with it.
Each rank of the distributed run takes its rdp slice of every micro-batch of that global batch.
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


def _reference(
    model_name: str, *, steps: int, accum: int, global_batch: int, clip: float
) -> tuple[list[float], bool, dict[str, torch.Tensor]]:
    """The single-process run on the whole global batch: its loss per step, whether clipping bit, and
    its final state."""
    build, make_batch = BUILDERS[model_name]
    ref = build()
    ref_opt = torch.optim.AdamW(_param_groups(ref), **ADAM)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    losses, clipped = [], False
    for step in range(steps):
        ref_total = 0.0
        for micro in range(accum):
            ref_loss = _loss(ref, make_batch(1000 * step + micro, global_batch))
            (ref_loss / accum).backward()
            ref_total += ref_loss.item() / accum
        if clip > 0:  # sdp_gradient_clipping=0 disables clipping
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            clipped |= bool(norm > clip)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        losses.append(ref_total)
    return losses, clipped, {k: v.detach().clone() for k, v in ref.state_dict().items()}


def run_parity(
    model_name: str, knobs: dict[str, Any], *, steps: int = 3, accum: int = 1, per_rank: int = 2, clip: float = 0.05
) -> dict[str, Any]:
    """Train both ways; return the max abs differences (losses, params) and whether clipping bit.

    The reference is deterministic (same seed, same batches, one thread), so rank 0 trains it once and
    broadcasts its losses and final state: every rank still compares its own run with it, without
    world-size copies of a full-batch run competing for the 2 cores."""
    import torch.distributed as dist

    build, make_batch = BUILDERS[model_name]
    smp.init({**knobs, "sdp_gradient_clipping": clip})
    try:
        rdp_rank, rdp_size = smp.rdp_rank(), smp.rdp_size()
        model = smp.DistributedModel(build(), backward_passes_per_step=accum)
        opt = smp.DistributedOptimizer(torch.optim.AdamW(_param_groups(model), **ADAM))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        dist_losses = []
        for step in range(steps):
            mine = []
            for micro in range(accum):
                batch = make_batch(1000 * step + micro, per_rank * rdp_size)
                local = {k: v[rdp_rank * per_rank : (rdp_rank + 1) * per_rank] for k, v in batch.items()}
                loss = _loss(model, local)
                model.backward(loss / accum)
                mine.append(loss.item())
            opt.step()
            opt.zero_grad()
            sched.step()
            dist_losses.append(sum(sum(x) for x in smp.allgather(mine, smp.CommGroup.RDP_GROUP)) / (accum * rdp_size))
        shared: list[Any] = [None]
        if smp.rank() == 0:
            shared[0] = _reference(model_name, steps=steps, accum=accum, global_batch=per_rank * rdp_size, clip=clip)
        dist.broadcast_object_list(shared, src=0)
        ref_losses, clipped, ref_state = shared[0]
        ours = model.state_dict()
        return {
            "loss": max(abs(a - b) for a, b in zip(dist_losses, ref_losses, strict=True)),
            "param": max((ours[k] - v).abs().max().item() for k, v in ref_state.items()),
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
