"""`smp.nn`: the SageMaker model-parallel v1 module names scripts use.

`FusedLayerNorm` is torch's LayerNorm, whose kernel is already fused on CPU and CUDA (v1 wrapped
apex's). `shardpar.nn.huggingface.<model>` holds v1's state-dict translation functions.
"""

from __future__ import annotations

from torch import nn


class FusedLayerNorm(nn.LayerNorm):
    """v1's `smp.nn.FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True)`: torch's
    LayerNorm, one fused kernel per call on every device that has one (CPU and CUDA do)."""


__all__ = ["FusedLayerNorm"]
