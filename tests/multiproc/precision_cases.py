"""Cases for test_precision.py (bf16/fp16, loss scaling, overflow) and delayed initialization."""

from __future__ import annotations

import math
from typing import Any

import torch

import shardpar as smp
from tests import models
from tests.multiproc.tp_cases import tiny_llama

SHARD = {"sdp_param_persistence_threshold": 10, "sharded_data_parallel_degree": 2}
# GPT-NeoX (rotary on a quarter of each head), Llama (full rotary, grouped-query attention, RMSNorm)
BUILDERS = {"neox": models.tiny_neox, "llama": tiny_llama}


def _bytes_by(records: list[Any]) -> dict[str, int]:
    """Bytes per "op/group" of one step's communication records."""
    out: dict[str, int] = {}
    for r in records:
        out[f"{r.op}/{r.group}"] = out.get(f"{r.op}/{r.group}", 0) + r.bytes
    return out


def _train_curve(knobs: dict[str, Any], steps: int, *, model_name: str = "neox") -> dict[str, Any]:
    smp.init({**SHARD, **knobs})
    try:
        model = smp.DistributedModel(BUILDERS[model_name]())
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
        rank, world = smp.rank(), smp.size()
        # The dtype the layers compute in: the compute parameters a block holds during its forward
        # (outside forward the modules hold the fp32 main parameters, runtime/user_params.py).
        seen: set[str] = set()
        for block in model.module.modules():
            if type(block).__name__.endswith("Layer"):
                block.register_forward_pre_hook(lambda m, a: seen.update(str(p.dtype) for p in m.parameters()))
        batches = [models.lm_batch(i, 2 * world) for i in range(4)]  # a small set, seen repeatedly
        curve: list[float] = []
        step_bytes: dict[str, int] = {}
        for step in range(steps):
            smp.comm_stats().begin_step()
            batch = batches[step % 4]
            loss = model(**{k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}).loss
            model.backward(loss)
            opt.step()  # closes the step's communication records (forward, backward, step)
            opt.zero_grad()
            if step == 0:
                step_bytes = _bytes_by(smp.comm_stats().history[-1])
            curve.append(sum(smp.allgather(loss.item())) / world)
        outside = sorted({str(p.dtype) for p in model.module.parameters()})
        ag_bytes = sum(b for k, b in step_bytes.items() if k.startswith("all_gather/"))
        return {
            "curve": curve,
            "ag_bytes": ag_bytes,
            "bytes": step_bytes,
            "param_dtypes": sorted(seen),
            "outside_dtypes": outside,
        }
    finally:
        smp.shutdown()


def bf16_vs_fp32_case(steps: int, model_name: str = "neox") -> dict[str, Any]:
    """The same training run in fp32, bf16 (fp32 reductions) and bf16 with bf16 reductions."""
    return {
        "fp32": _train_curve({}, steps, model_name=model_name),
        "bf16": _train_curve({"bf16": True}, steps, model_name=model_name),
        "bf16_reduce_bf16": _train_curve({"bf16": True, "sdp_reduce_dtype": "bf16"}, steps, model_name=model_name),
    }


def _snapshot(model: Any, opt: Any) -> list[torch.Tensor]:
    tensors = [u.main_shard.clone() for u in model.units] + [model.persistent.main.clone()]
    for state in opt.state.values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def fp16_overflow_case(steps: int, inject_every: int) -> dict[str, Any]:
    """Inject an inf into one rank's gradient shard every `inject_every` steps."""
    smp.init({**SHARD, "fp16": True})
    model = smp.DistributedModel(models.tiny_neox())
    opt = smp.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**8, "scale_window": 5, "min_scale": 1.0},
    )
    rank, world = smp.rank(), smp.size()
    events: list[dict[str, Any]] = []
    nan_in_params = False
    for step in range(steps):
        batch = models.lm_batch(step % 5, 2 * world)
        loss = model(**{k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}).loss
        model.backward(loss)
        inject = step % inject_every == inject_every - 1
        if inject and rank == 1:
            model.units[1].main_grad[0] = float("inf")  # only this rank sees it
        before = _snapshot(model, opt) if inject else None
        scale_before = opt.loss_scaler.loss_scale
        opt.step()
        opt.zero_grad()
        if before is not None:
            after = _snapshot(model, opt)
            untouched = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
            events.append(
                {
                    "step": step,
                    "overflow": opt.overflow,
                    "untouched": untouched,
                    "scale_before": scale_before,
                    "scale_after": opt.loss_scaler.loss_scale,
                }
            )
        else:
            events.append(
                {
                    "step": step,
                    "overflow": opt.overflow,
                    "scale_before": scale_before,
                    "scale_after": opt.loss_scaler.loss_scale,
                }
            )
        nan_in_params |= any(not torch.isfinite(u.main_shard).all() for u in model.units)
        nan_in_params |= not bool(torch.isfinite(model.persistent.main).all())
    return {
        "events": events,
        "nan": nan_in_params,
        "scaler_state": opt.state_dict()["loss_scaler"],
        "final_loss": float(loss.item()),
    }


def fp16_static_overflow_case() -> dict[str, Any]:
    """fp16 with the defaults that used to skip the check (static scale 1.0, no clipping): an inf on
    rank 1 only must still skip the step on every rank, through the one sharding-group AllReduce."""
    smp.init({**SHARD, "fp16": True, "sdp_gradient_clipping": 0.0})
    model = smp.DistributedModel(models.tiny_neox())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    rank, world = smp.rank(), smp.size()
    stats = smp.comm_stats()

    def backward(step: int) -> None:
        batch = models.lm_batch(step, 2 * world)
        model.backward(model(**{k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}).loss)
        stats.begin_step()  # the optimizer step's collectives are recorded on their own

    backward(0)
    opt.step()  # a clean step first, so there is optimizer state to leave untouched
    opt.zero_grad()
    clean_overflow = opt.overflow
    backward(1)
    if rank == 1:
        model.units[1].main_grad[0] = float("inf")
    before = _snapshot(model, opt)
    closed = stats.num_steps
    opt.step()
    step_collectives = [(r.op, r.group) for records in stats.steps_since(closed) for r in records]
    after = _snapshot(model, opt)
    opt.zero_grad()
    overflow = opt.overflow
    backward(2)
    opt.step()  # the next clean step is taken again
    return {
        "clean_overflow": clean_overflow,
        "overflow": overflow,
        "untouched": len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        "num_state_tensors": len(before) - len(model.units) - 1,
        "step_collectives": step_collectives,
        "scale": opt.loss_scaler.loss_scale,
        "recovered": not opt.overflow,
        "finite": all(bool(torch.isfinite(t).all()) for t in _snapshot(model, opt)),
    }


def fp16_loss_scale_case(clip: float, scale: float, steps: int = 3, dynamic: bool = False) -> dict[str, Any]:
    """fp16 with a loss scale under SGD (not scale-invariant, unlike Adam): the grad norm seen by
    clipping and the update must not depend on the scale, so a missing or doubled unscale, or
    clipping applied to the scaled gradients, shows up as a factor of `scale`. `dynamic`: a dynamic
    scaler starting at `scale` that doubles after every clean step (scale_window 1)."""
    smp.init({**SHARD, "fp16": True, "sdp_gradient_clipping": clip})
    try:
        model = smp.DistributedModel(models.tiny_neox())
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        if dynamic:
            args = {"init_scale": scale, "scale_window": 1}
            opt = smp.DistributedOptimizer(sgd, dynamic_loss_scale=True, dynamic_loss_args=args)
        else:
            opt = smp.DistributedOptimizer(sgd, static_loss_scale=scale)
        rank, world = smp.rank(), smp.size()
        start = [u.main_shard.clone() for u in model.units]
        norms: list[float] = []
        for step in range(steps):
            batch = models.lm_batch(step, 2 * world)
            model.backward(model(**{k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}).loss)
            opt.step()
            opt.zero_grad()
            norms.append(float(opt.last_grad_norm))
        update = torch.cat([(u.main_shard - s).flatten() for u, s in zip(model.units, start, strict=True)])
        return {
            "norms": norms,
            "update": update.tolist(),
            "overflow": opt.overflow,
            "final_scale": opt.loss_scaler.loss_scale,
        }
    finally:
        smp.shutdown()


def delayed_init_case() -> dict[str, Any]:
    """A model built under smp.delay_param_initialization() equals the normal init, shard by shard."""
    smp.init({**SHARD})
    with smp.delay_param_initialization():
        deferred = models.tiny_neox(seed=3)
    meta_before = all(p.is_meta for p in deferred.parameters())
    model = smp.DistributedModel(deferred)
    no_full_params = all(p.numel() == 0 for u in model.units for p in u.params)
    ours = model.state_dict()
    reference = models.tiny_neox(seed=3).state_dict()
    exact = all(torch.equal(ours[k], reference[k]) for k in reference)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    loss = model(**models.lm_batch(0, 2)).loss
    model.backward(loss)
    opt.step()
    return {"meta_before": meta_before, "no_full": no_full_params, "exact": exact, "finite": math.isfinite(loss.item())}


def init_empty_weights_case() -> dict[str, Any]:
    """accelerate's init_empty_weights: materialised with each module's own reset_parameters (seeded
    alike on every rank); a parameter whose module has no reset_parameters is a clear error."""
    from accelerate import init_empty_weights
    from torch import nn

    smp.init({**SHARD})
    with init_empty_weights():
        module = nn.Sequential(nn.Linear(13, 16), nn.LayerNorm(16), nn.Linear(16, 5))
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    batch = models.mlp_batch(0, 4)
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    model.backward(loss)
    opt.step()
    full = model.state_dict()
    same_on_ranks = smp.allgather(float(sum(v.double().sum() for v in full.values())))
    with init_empty_weights():
        bad = models.UnevenMLP()
    try:
        smp.DistributedModel(bad)
        error = ""
    except ValueError as e:
        error = str(e)
    return {
        "finite": math.isfinite(loss.item()),
        "same": len(set(same_on_ranks)) == 1,
        "nonzero": bool(full["0.weight"].abs().sum() > 0),
        "error": error,
    }
