"""bf16 cases for test_owner_compute.py (issue 31's "bf16 within its tolerance"): shape-aware optimizers
stepped whole on owners under `bf16=True`, against one process doing the same mixed-precision arithmetic.

[Note: the bf16 reference]
shardpar's bf16 (precision.py): forward and backward in bf16 copies of the fp32 main values, each rank's
bf16 gradients reduced in fp32 into fp32 main grads, the optimizer stepping fp32 values. A reference
that ran bf16 on the whole global batch would round other sums in bf16 (a bf16 matmul over 8 rows is
not two over 4 rows added in fp32) and differ from us by bf16 noise, which hides any bug smaller than
it. So the reference does what the ranks do: per micro-batch, per rdp slice, one bf16 forward/backward
on a bf16 copy of its fp32 master (parameters cast, buffers kept as they are, inputs cast as
runtime/boundary_cast.py casts them), the bf16 gradients added in fp32, clip and step in fp32. What is
left is fp32 summation order, as in the fp32 cases -- and what bf16 does with it: a master value 1 ulp
(fp32) away casts to a neighbouring bf16 value when it sits on a rounding boundary, which moves that
element's gradients by bf16's relative rounding (2^-9). See test_owner_compute.py for the tolerance.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import shardpar as smp
from shardpar.api.data import rdp_slice
from tests.multiproc import owner_cases, parity


def _bf16_copy(master: nn.Module) -> nn.Module:
    """The compute copy: parameters in bf16, buffers as they are (rotary inv_freq stays fp32)."""
    copy16 = copy.deepcopy(master)
    for p in copy16.parameters():
        p.data = p.data.to(torch.bfloat16)
    return copy16


def _refresh(copy16: nn.Module, master: nn.Module) -> None:
    with torch.no_grad():
        for p16, p in zip(copy16.parameters(), master.parameters(), strict=True):
            p16.copy_(p)  # cast to bf16, round to nearest even, as the runtime's compute refresh


def _to_bf16(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in batch.items()}


def owner_parity_bf16(kind: str, model_name: str, knobs: dict[str, Any], steps: int = 4, accum: int = 2) -> dict:
    per_rank, clip = 2, 0.05
    smp.init({"sdp_param_persistence_threshold": 10, **knobs, "bf16": True, "sdp_gradient_clipping": clip})
    try:
        build, make_batch = parity.BUILDERS[model_name]
        model = smp.DistributedModel(build(), backward_passes_per_step=accum)
        opt = smp.DistributedOptimizer(owner_cases.make_optimizer(kind, model))
        ref = build()
        ref16 = _bf16_copy(ref)
        ref_opt = owner_cases._as_one(owner_cases.make_optimizer(kind, ref))
        size = smp.rdp_size()
        loss_diff, clipped = 0.0, False
        for step in range(steps):
            full = [make_batch(1000 * step + micro, per_rank * size) for micro in range(accum)]
            mine = owner_cases.train_step(model, opt, full, accum)
            _refresh(ref16, ref)
            grads = [torch.zeros_like(p) for p in ref.parameters()]
            ref_total = 0.0
            for batch in full:
                for r in range(size):
                    ref16.zero_grad()
                    part = _to_bf16(rdp_slice(batch, rdp_rank=r, rdp_size=size))
                    ref_loss = parity._loss(ref16, part).float()
                    (ref_loss / accum).backward()
                    ref_total += ref_loss.item() / (accum * size)
                    for g, p16 in zip(grads, ref16.parameters(), strict=True):
                        if p16.grad is not None:
                            g += p16.grad.float()
            for p, g in zip(ref.parameters(), grads, strict=True):
                p.grad = g / size  # the rdp mean (a power of two: exact wherever it is taken)
            clipped |= bool(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip) > clip)
            ref_opt.step()
            ref_opt.zero_grad()
            gathered = smp.allgather(mine, smp.CommGroup.RDP_GROUP)
            loss_diff = max(loss_diff, abs(sum(sum(x) for x in gathered) / (accum * size) - ref_total))
        ours = {k: v.float() for k, v in model.state_dict().items()}
        diffs = {k: (ours[k] - v.float()).abs().max().item() for k, v in ref.state_dict().items()}
        return {
            "loss": loss_diff,
            "param": max(diffs.values()),
            "worst": max(diffs, key=diffs.__getitem__),
            "clipped": float(clipped),
            "planned": sum(len(oc.plan.owned) for oc in opt.owners),
            "compute": str(model.policy.compute),
        }
    finally:
        smp.shutdown()


def run_many_bf16(cases: list[tuple[str, str, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [owner_parity_bf16(kind, name, knobs) for kind, name, knobs in cases]
