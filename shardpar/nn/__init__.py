"""`smp.nn`: the SageMaker model-parallel v1 module names scripts use.

`FusedLayerNorm` is torch's LayerNorm, whose kernel is already fused on CPU and CUDA (v1 wrapped
apex's). `shardpar.nn.huggingface.<model>` holds v1's state-dict translation functions.

v1's `Distributed*` modules (DistributedTransformer, DistributedLinear, ...) were its own tensor-parallel
implementations to build a model from. shardpar splits Hugging Face's modules in place instead, so the
names exist -- `isinstance(m, smp.nn.DistributedTransformerLayer)` is simply False for every module
here -- and building one is an error that says what to do instead.
"""

from __future__ import annotations

from torch import nn


class FusedLayerNorm(nn.LayerNorm):
    """v1's `smp.nn.FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True)`: torch's
    LayerNorm, one fused kernel per call on every device that has one (CPU and CUDA do)."""


class _V1DistributedModule(nn.Module):
    """A v1 `smp.nn.Distributed*` class: a name to test against, not a module to build (module docstring)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError(
            f"smp.nn.{type(self).__name__} is SMP v1's own tensor-parallel module, which shardpar does not have: "
            "build the Hugging Face model (GPT-NeoX, Llama, GPT-2) inside smp.model_creation(tensor_parallelism=True) "
            "or smp.tensor_parallelism(), and smp.DistributedModel splits its blocks, embeddings and LM head over the "
            "TP group (docs/tensor_parallelism.md)"
        )


class DistributedLinear(_V1DistributedModule):
    pass


class DistributedEmbedding(_V1DistributedModule):
    pass


class DistributedTransformer(_V1DistributedModule):
    pass


class DistributedTransformerLayer(_V1DistributedModule):
    pass


class DistributedTransformerLMHead(_V1DistributedModule):
    pass


class DistributedAttentionLayer(_V1DistributedModule):
    pass


class DistributedTransformerOutputLayer(_V1DistributedModule):
    pass


__all__ = [
    "DistributedAttentionLayer",
    "DistributedEmbedding",
    "DistributedLinear",
    "DistributedTransformer",
    "DistributedTransformerLMHead",
    "DistributedTransformerLayer",
    "DistributedTransformerOutputLayer",
    "FusedLayerNorm",
]
