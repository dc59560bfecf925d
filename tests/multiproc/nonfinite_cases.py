"""Cases for test_nonfinite.py, run on every rank of a pool (importable for spawn)."""

from __future__ import annotations

import logging
from typing import Any

import torch

import shardpar as smp
from shardpar.optim.nonfinite import NonFiniteError
from tests import models
from tests.multiproc.parity import ADAM

# world 4, sdp 2: two replicas, so a NaN must cross the replication AllReduce to reach every rank
SHARD = {"sdp_param_persistence_threshold": 10, "sharded_data_parallel_degree": 2}
PRECISION = {"fp32": {}, "bf16": {"bf16": True}, "fp16": {"fp16": True}}
PER_RANK = 2


def _nan_grad_hook(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
    out.register_hook(lambda g: g * float("nan"))  # backward goes NaN; the loss stays finite


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def nonfinite_case(precision: str, inject: str, limit: int = 1) -> dict[str, Any]:
    """A clean step, a poisoned step (skipped), a clean step (trains), then poisoned steps until
    sdp_max_nonfinite_steps=`limit` is exceeded. `inject`: loss_one (a NaN added to rank 1's loss:
    its gradients alone would be finite), grad_one (rank 2's backward goes NaN, its loss is finite),
    data_one (an inf in rank 3's input), loss_all (a NaN loss on every rank)."""
    smp.init({**SHARD, **PRECISION[precision], "sdp_max_nonfinite_steps": limit})
    capture = _Capture()
    logging.getLogger("shardpar").addHandler(capture)
    try:
        return _run(precision, inject, limit, capture)
    finally:
        logging.getLogger("shardpar").removeHandler(capture)


def _run(precision: str, inject: str, limit: int, capture: _Capture) -> dict[str, Any]:
    torch.manual_seed(0)
    model = smp.DistributedModel(models.UnevenMLP())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), **ADAM))
    torch.manual_seed(0)
    ref = models.UnevenMLP()
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAM)
    rank, world = smp.rank(), smp.size()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    bad_rank = {"loss_one": 1, "grad_one": 2, "data_one": 3, "loss_all": rank}[inject]

    def backward(step: int, poisoned: bool) -> None:
        batch = models.mlp_batch(step, PER_RANK * world)
        local = {k: v[PER_RANK * rank : PER_RANK * rank + PER_RANK] for k, v in batch.items()}
        local["x"] = local["x"].to(dtype)
        hit = poisoned and rank == bad_rank
        if hit and inject == "data_one":
            local["x"][0, 5] = float("inf")
        hook = model.module.blocks[1].register_forward_hook(_nan_grad_hook) if hit and inject == "grad_one" else None
        loss = model(**local)
        if hit and inject in ("loss_one", "loss_all"):
            loss = loss + float("nan")
        model.backward(loss)
        if hook is not None:
            hook.remove()

    def ref_step(step: int) -> None:
        ref(**models.mlp_batch(step, PER_RANK * world)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)  # sdp_gradient_clipping's default
        ref_opt.step()
        ref_opt.zero_grad()

    def attempt(step: int) -> tuple[str, bool]:
        """A poisoned step: (the NonFiniteError's message or "", whether the state stayed bit-identical)."""
        backward(step, True)
        before = models.shard_state(model, opt)
        try:
            opt.step()
            error = ""
        except NonFiniteError as e:
            error = str(e)
        opt.zero_grad()
        return error, models.same_tensors(before, models.shard_state(model, opt))

    out: dict[str, Any] = {}
    backward(0, False)
    opt.step()
    opt.zero_grad()
    ref_step(0)
    before = models.shard_state(model, opt)
    out["first_error"], out["untouched"] = attempt(1)
    out["skipped"] = opt.skipped
    backward(2, False)
    opt.step()  # trains normally again
    opt.zero_grad()
    ref_step(2)
    out["stepped_after"] = not opt.skipped and not models.same_tensors(before, models.shard_state(model, opt))
    out["param_diff"] = models.max_param_diff(model, ref)
    out["finite"] = all(bool(torch.isfinite(v).all()) for v in model.state_dict().values())
    out["errors"], out["untouched_at_error"], out["scales"] = [], True, []
    for step in range(3, 3 + limit + 2):
        error, untouched = attempt(step)
        out["untouched_at_error"] &= untouched
        out["scales"].append(opt.loss_scaler.loss_scale)
        if error:
            out["errors"].append((step, error))
            break
    out["logs"] = list(capture.messages)
    return out


def count_step_collectives_case(clip: float) -> dict[str, Any]:
    """The collectives of one healthy optimizer step: with clipping off the norm is one more
    AllReduce of one float, and a healthy step gains nothing else."""
    smp.init({**SHARD, "sdp_gradient_clipping": clip})
    model = smp.DistributedModel(models.UnevenMLP())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), **ADAM))
    stats = smp.comm_stats()
    rank, world = smp.rank(), smp.size()
    batch = models.mlp_batch(0, PER_RANK * world)
    model.backward(model(**{k: v[PER_RANK * rank : PER_RANK * rank + PER_RANK] for k, v in batch.items()}))
    stats.begin_step()
    opt.step()
    return {"step": [(r.op, r.group, r.bytes) for r in stats.history[-1]]}
