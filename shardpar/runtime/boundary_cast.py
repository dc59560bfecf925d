"""SMP v1's fp16 model boundary, for fp16 and bf16 compute: floating-point inputs are cast to the compute
dtype on their way into the wrapped module and its compute-dtype outputs back to fp32 on their way out,
as v1's fp16 wrapper did (Megatron's FP16_Module). Without it an fp32 input (pixel values, `inputs_embeds`,
a float mask) meets the half-precision weights in the first matmul and fails there ("mat1 and mat2 must
have the same dtype"). Integer inputs (token ids, labels) are left alone; so is anything outside the
containers torch's pytree knows (tuples, lists, dicts, namedtuples, HF ModelOutputs)."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn


def call_in_compute_dtype(module: nn.Module, compute: torch.dtype, args: Any, kwargs: Any) -> Any:
    """`module(*args, **kwargs)` with the boundary casts; a plain call when `compute` is fp32."""
    if compute == torch.float32:
        return module(*args, **kwargs)

    def inward(t: torch.Tensor) -> torch.Tensor:
        return t.to(compute) if t.is_floating_point() and t.dtype != compute else t

    def outward(t: torch.Tensor) -> torch.Tensor:
        return t.float() if t.dtype == compute else t

    args, kwargs = pytree.tree_map_only(torch.Tensor, inward, (args, kwargs))
    return pytree.tree_map_only(torch.Tensor, outward, module(*args, **kwargs))
