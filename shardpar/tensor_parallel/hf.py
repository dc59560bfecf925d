"""Convert Hugging Face GPT-NeoX, Llama (grouped-query attention included) and GPT-2 models to tensor
parallelism in place, and gather a TP model's tensors back to the Hugging Face layout.

Per transformer block (Megatron-LM's split; SageMaker reference 003 "Sharded data parallelism with
tensor parallelism", which also distributes the embeddings):

    family    column-parallel (heads / intermediate split)     row-parallel (input split)
    GPT-NeoX  attention.query_key_value, mlp.dense_h_to_4h     attention.dense, mlp.dense_4h_to_h
    Llama     self_attn.{q,k,v}_proj, mlp.{gate,up}_proj        self_attn.o_proj, mlp.down_proj
    GPT-2     attn.c_attn (3 fused parts), mlp.c_fc            attn.c_proj, mlp.c_proj

The input embedding becomes a VocabParallelEmbedding and the LM head a ColumnParallelLinear over the
vocabulary (tied weights stay tied). LayerNorm/RMSNorm, position embeddings and row-parallel biases
stay replicated. Each rank copies its slices from TP rank 0's full parameters (broadcast one at a
time), so the TP ranks hold one consistent model, equal to TP rank 0's unconverted one, however they
were seeded.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from shardpar.sharding.deferred_init import is_deferred, materialize
from shardpar.sharding.tp_split import TPSplit
from shardpar.tensor_parallel.comm import TPComm, copy_to_tp_region
from shardpar.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPLayer,
    VocabParallelEmbedding,
)
from shardpar.tensor_parallel.loss import VocabParallelCausalLMLoss

Include = Callable[[nn.Module], bool]

# (config attribute, what it counts) that tensor_parallel_degree must divide, per model_type
_DIVISIBLE: dict[str, tuple[tuple[str, str], ...]] = {
    "gpt_neox": (
        ("num_attention_heads", "attention heads"),
        ("intermediate_size", "MLP intermediate features"),
        ("vocab_size", "vocabulary rows"),
    ),
    "llama": (
        ("num_attention_heads", "attention heads"),
        ("num_key_value_heads", "key/value heads (grouped-query attention)"),
        ("intermediate_size", "MLP intermediate features"),
        ("vocab_size", "vocabulary rows"),
    ),
    "gpt2": (
        ("n_head", "attention heads"),
        ("n_inner", "MLP intermediate features"),
        ("vocab_size", "vocabulary rows"),
    ),
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _family(model: nn.Module) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _DIVISIBLE:
        raise TypeError(
            f"tensor parallelism converts Hugging Face GPT-NeoX, Llama and GPT-2 models; got "
            f"{type(model).__name__} (model_type={model_type!r})"
        )
    return str(model_type)


def _dimension(config: Any, attr: str) -> tuple[str, int]:
    """(how to name it, value) of a config dimension, resolving the HF defaults that are None."""
    value = getattr(config, attr, None)
    if value is not None:
        return attr, int(value)
    if attr == "n_inner":
        return "n_inner (None: 4 x n_embd)", 4 * int(config.n_embd)
    if attr == "num_key_value_heads":
        return "num_key_value_heads (None: num_attention_heads)", int(config.num_attention_heads)
    raise ValueError(f"the {config.model_type} config has no {attr}; cannot plan the tensor-parallel split")


def check_tp_divisibility(config: Any, tp: int) -> None:
    """Raise ValueError naming the first dimension of `config` that `tp` TP ranks cannot split."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _DIVISIBLE:
        raise TypeError(f"tensor parallelism supports model_type gpt_neox, llama and gpt2; got {model_type!r}")
    for attr, what in _DIVISIBLE[model_type]:
        label, value = _dimension(config, attr)
        if value % tp:
            raise ValueError(
                f"tensor_parallel_degree={tp} must divide {label}={value} of this {model_type} model: its "
                f"{what} are split across the TP ranks; use a tensor_parallel_degree in {_divisors(value)}"
            )
    if model_type == "gpt2" and getattr(config, "add_cross_attention", False):
        raise ValueError("tensor parallelism does not convert GPT-2 cross-attention (add_cross_attention=True)")


def _full(p: torch.Tensor | None, comm: TPComm) -> torch.Tensor | None:
    """TP rank 0's full value of a parameter (a collective over the TP group; a delayed-initialized one
    is built there, one at a time). Every TP rank then slices the same full tensor, so the TP layers
    hold one model even where the ranks were seeded apart ([Note: rank 0's initial values],
    runtime/initial_values.py)."""
    if p is None:
        return None
    if p.is_meta and not is_deferred(p):
        raise ValueError(
            "tensor parallelism needs parameter values to slice; build the model normally or under "
            "smp.delay_param_initialization(), not on the meta device"
        )
    if comm.rank == 0 or comm.size == 1 or comm.group.handle is None:
        value = materialize(p) if is_deferred(p) else p.detach()
    else:
        value = torch.empty(p.shape, dtype=p.dtype, device="cpu" if p.is_meta else p.device)
    return nn.Parameter(comm.broadcast_from_first(value), requires_grad=p.requires_grad)


def _column(linear: Any, comm: TPComm, **kw: Any) -> ColumnParallelLinear:
    w = _full(linear.weight, comm)
    if w is None:
        raise AssertionError(f"{type(linear).__name__} without a weight")
    return ColumnParallelLinear(w, _full(linear.bias, comm), comm, transposed=_is_conv1d(linear), **kw)


def _row(linear: Any, comm: TPComm) -> RowParallelLinear:
    w = _full(linear.weight, comm)
    if w is None:
        raise AssertionError(f"{type(linear).__name__} without a weight")
    return RowParallelLinear(w, _full(linear.bias, comm), comm, transposed=_is_conv1d(linear))


def _is_conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D"  # transformers.pytorch_utils.Conv1D: weight is [in, out]


def _copy_output_to_tp(comm: TPComm) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]:
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return copy_to_tp_region(output, comm)

    return hook


# ---- per-family block conversion ---------------------------------------------------------------


def _convert_neox_block(layer: Any, comm: TPComm, include: Include) -> None:
    if include(layer.attention):
        att = layer.attention
        att.query_key_value = _column(att.query_key_value, comm)  # rows grouped per head: [q k v] x heads
        att.dense = _row(att.dense, comm)
    if include(layer.mlp):
        layer.mlp.dense_h_to_4h = _column(layer.mlp.dense_h_to_4h, comm)
        layer.mlp.dense_4h_to_h = _row(layer.mlp.dense_4h_to_h, comm)


def _convert_llama_block(layer: Any, comm: TPComm, include: Include) -> None:
    # The norm's output feeds only q/k/v (resp. gate/up): ONE copy_to_tp region on it makes backward
    # all-reduce their summed input grad once, instead of once per projection.
    att, mlp = layer.self_attn, layer.mlp
    if include(att):
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(att, name, _column(getattr(att, name), comm, copy_input=False))
        att.o_proj = _row(att.o_proj, comm)
        layer.input_layernorm.register_forward_hook(_copy_output_to_tp(comm))
    if include(mlp):
        mlp.gate_proj = _column(mlp.gate_proj, comm, copy_input=False)
        mlp.up_proj = _column(mlp.up_proj, comm, copy_input=False)
        mlp.down_proj = _row(mlp.down_proj, comm)
        layer.post_attention_layernorm.register_forward_hook(_copy_output_to_tp(comm))


def _convert_gpt2_block(layer: Any, comm: TPComm, include: Include) -> None:
    att, mlp = layer.attn, layer.mlp
    if include(att):
        att.c_attn = _column(att.c_attn, comm, num_parts=3)  # [q | k | v]: each part split by heads
        att.c_proj = _row(att.c_proj, comm)
        # GPT2Attention splits c_attn's output with split_size: now the local width.
        att.split_size //= comm.size
        att.embed_dim //= comm.size
        att.num_heads //= comm.size
    if include(mlp):
        mlp.c_fc = _column(mlp.c_fc, comm)
        mlp.c_proj = _row(mlp.c_proj, comm)


_BLOCKS: dict[str, tuple[str, Callable[[Any, TPComm, Include], None]]] = {  # HF modules: untyped attributes
    "gpt_neox": ("GPTNeoXLayer", _convert_neox_block),
    "llama": ("LlamaDecoderLayer", _convert_llama_block),
    "gpt2": ("GPT2Block", _convert_gpt2_block),
}


# ---- embeddings ---------------------------------------------------------------------------------


def _replace(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for name, m in root.named_modules():
        if m is old:
            parent_name, _, leaf = name.rpartition(".")
            setattr(root.get_submodule(parent_name), leaf, new)
            return
    raise AssertionError(f"{type(old).__name__} not found under {type(root).__name__}")


def _embeddings(model: Any) -> tuple[Any, Any, bool]:
    """(input embedding, LM head or None, whether they share one weight)."""
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return emb, head, head is not None and head.weight is emb.weight


def _check_tied_embeddings(model: Any, include: Include) -> None:
    emb, head, tied = _embeddings(model)
    if not tied or include(emb) == include(head):
        return
    split, kept = ("input embedding", "LM head") if include(emb) else ("LM head", "input embedding")
    raise ValueError(
        f"the {split} is marked for tensor parallelism but the {kept} is not, and they share one weight "
        "(tied word embeddings): one parameter cannot be both split and replicated. Build both under the "
        "same smp.tensor_parallelism() setting, or untie them (config.tie_word_embeddings=False)"
    )


def _convert_embeddings(model: Any, comm: TPComm, include: Include, vocab_parallel_loss: bool) -> None:
    emb, head, tied = _embeddings(model)
    new_emb: VocabParallelEmbedding | None = None
    if include(emb):
        weight = _full(emb.weight, comm)
        if weight is None:
            raise AssertionError("input embedding without a weight")
        new_emb = VocabParallelEmbedding(weight, comm, padding_idx=emb.padding_idx)
        _replace(model, emb, new_emb)
    if head is None or not include(head):
        if vocab_parallel_loss:
            raise ValueError("vocab_parallel_loss=True needs the LM head converted to tensor parallelism")
        return
    new_head = _column(head, comm, gather_output=not vocab_parallel_loss)
    if tied and new_emb is not None:
        new_head.weight = new_emb.weight  # stay tied: one parameter, one vocabulary split
    _replace(model, head, new_head)
    if vocab_parallel_loss:
        model.loss_function = VocabParallelCausalLMLoss(comm)


# config attributes of the dropout on attention probabilities, which runs inside the TP region
_ATTENTION_DROPOUT = ("attn_pdrop", "attention_dropout")


def _warn_attention_dropout(config: Any, tp: int) -> None:
    for name in _ATTENTION_DROPOUT:
        p = getattr(config, name, 0.0) or 0.0
        if tp > 1 and p > 0:
            warnings.warn(
                f"{name}={p} with tensor_parallel_degree={tp}: attention dropout runs on each rank's own heads "
                "with the same random stream on every TP rank (there is no per-TP-rank RNG stream yet), so "
                f"heads on different TP ranks drop the same positions. Set config.{name}=0 for independent "
                "heads, or accept the correlated masks",
                stacklevel=3,
            )


def convert_hf_model(
    model: nn.Module, comm: TPComm, *, vocab_parallel_loss: bool = False, include: Include | None = None
) -> nn.Module:
    """Convert `model` in place (and return it) to tensor parallelism over `comm`'s TP group.

    `include(module)` (default: everything) picks which attention / MLP / embedding modules to split.
    With `vocab_parallel_loss=True` the LM head returns this rank's vocabulary slice of the logits and
    the model's loss is the vocab-parallel cross-entropy; otherwise the logits are all-gathered and the
    model's own loss runs on them unchanged.
    """
    family = _family(model)
    converted = next((name for name, m in model.named_modules() if isinstance(m, TPLayer)), None)
    if converted is not None:
        raise ValueError(
            f"{type(model).__name__} is already tensor parallel ({converted or 'the model'} is a TP layer); "
            "converting again would split the split weights. Convert once: either convert_hf_model, or "
            "smp.DistributedModel(tensor_parallelism=True) / smp.tensor_parallelism(), not both"
        )
    check_tp_divisibility(model.config, comm.size)
    if not hasattr(model, "get_input_embeddings"):
        raise TypeError(f"{type(model).__name__} has no get_input_embeddings(); pass a Hugging Face model")
    choose = include or (lambda m: True)
    block_class, convert_block = _BLOCKS[family]
    blocks = [m for m in model.modules() if type(m).__name__ == block_class]
    if not blocks:
        raise TypeError(f"no {block_class} found in {type(model).__name__}; nothing to split")
    _check_tied_embeddings(model, choose)
    _warn_attention_dropout(model.config, comm.size)
    for block in blocks:
        convert_block(block, comm, choose)
    _convert_embeddings(model, comm, choose, vocab_parallel_loss)
    return model


# ---- back to the Hugging Face layout ------------------------------------------------------------


def gather_full_state_dict(
    state_dict: Mapping[str, torch.Tensor], splits: Mapping[str, TPSplit], comm: TPComm
) -> dict[str, torch.Tensor]:
    """TP-local tensors -> the original Hugging Face layout.

    `state_dict`: this TP rank's tensors under the model's FQNs (e.g. `DistributedModel.state_dict()`,
    full over the sharding group, local over TP); `splits`: `tp_split_table(model)`. Each TP-split entry
    is all-gathered over the TP group and reassembled (`TPSplit.full_of`); the others are returned
    as they are. A collective over the TP group: every TP rank calls it with the same keys, in order.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        split = splits.get(key)
        out[key] = value if split is None else split.full_of(list(comm.all_gather_stack(value).unbind(0)))
    return out


def shard_full_state_dict(
    state_dict: Mapping[str, torch.Tensor], splits: Mapping[str, TPSplit], rank: int
) -> dict[str, torch.Tensor]:
    """The inverse (pure, no communication): TP rank `rank`'s tensors from a Hugging Face state dict,
    ready for `DistributedModel.load_state_dict` of a converted model."""
    return {k: (v if k not in splits else splits[k].local_of(v, rank).clone()) for k, v in state_dict.items()}


def full_shapes(
    local_shapes: Mapping[str, tuple[int, ...]], splits: Mapping[str, TPSplit]
) -> dict[str, tuple[int, ...]]:
    """FQN -> shape in the Hugging Face layout, from TP-local shapes (e.g. a unit layout's specs)."""
    return {k: splits[k].full_shape(s) if k in splits else tuple(s) for k, s in local_shapes.items()}
