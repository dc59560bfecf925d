"""Mixed precision: the dtype policy (the fp16 loss scalers are optim/loss_scaling.py).

    bf16 / fp16:  AllGather and compute in the half dtype (half the AllGather bytes); gradients
                  reduced in fp32 by default (`sdp_reduce_dtype`), accumulated and stepped in fp32
                  main shards; compute shards refreshed from the main shards after each step.
    fp16 only:    the loss is scaled (static or dynamic) so small gradients survive fp16; an inf/nan
                  on any rank skips the step everywhere and lowers a dynamic scale.

The dynamic scaler follows the SMP v1 / DeepSpeed `DynamicLossScaler` arguments and update rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardpar.config import Config

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class DtypePolicy:
    compute: torch.dtype  # parameters gathered and used in forward/backward
    reduce: torch.dtype  # gradient ReduceScatter / AllReduce
    main: torch.dtype = torch.float32  # optimizer shards and accumulated gradients

    @classmethod
    def from_config(cls, config: Config) -> DtypePolicy:
        compute = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else torch.float32
        reduce = _DTYPES[config.sdp_reduce_dtype]
        if reduce not in (torch.float32, compute):
            raise ValueError(
                f"sdp_reduce_dtype={config.sdp_reduce_dtype!r} must be 'fp32' or the compute dtype "
                f"({precision_name(compute)}); set bf16/fp16 accordingly or use 'fp32'"
            )
        return cls(compute=compute, reduce=reduce)

    @property
    def is_mixed(self) -> bool:
        return self.compute != self.main


def precision_name(dtype: torch.dtype) -> str:
    """'fp32', 'bf16' or 'fp16': the knob-style name of a compute dtype (also what checkpoints record)."""
    return next(k for k, v in _DTYPES.items() if v == dtype)
