"""Tensor parallelism combined with sharded data parallelism (reference 003, "Sharded data
parallelism with tensor parallelism"): TP layers, communication regions, Hugging Face conversion,
vocab-parallel loss (TP-aware clipping is optim/grad_norm.py; the prescaled-batch helper smp.rdp_slice). See
docs/tensor_parallelism.md."""

from shardpar.sharding.tp_split import TPSplit
from shardpar.tensor_parallel.comm import (
    TPComm,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
)
from shardpar.tensor_parallel.hf import (
    check_tp_divisibility,
    convert_hf_model,
    full_shapes,
    gather_full_state_dict,
    shard_full_state_dict,
)
from shardpar.tensor_parallel.layers import (
    ColumnParallelLinear,
    HeadParallelEmbedding,
    RowParallelLinear,
    TPLayer,
    VocabParallelEmbedding,
    tp_split_table,
)
from shardpar.tensor_parallel.loss import VocabParallelCausalLMLoss, vocab_parallel_cross_entropy
from shardpar.tensor_parallel.marks import ModuleMarks, TPOptions, prepare_model
from shardpar.tensor_parallel.plans import FAMILIES, family_names

__all__ = [
    "FAMILIES",
    "ColumnParallelLinear",
    "HeadParallelEmbedding",
    "ModuleMarks",
    "RowParallelLinear",
    "TPComm",
    "TPLayer",
    "TPOptions",
    "TPSplit",
    "VocabParallelCausalLMLoss",
    "VocabParallelEmbedding",
    "check_tp_divisibility",
    "convert_hf_model",
    "copy_to_tp_region",
    "family_names",
    "full_shapes",
    "gather_from_tp_region",
    "gather_full_state_dict",
    "prepare_model",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "shard_full_state_dict",
    "tp_split_table",
    "vocab_parallel_cross_entropy",
]
