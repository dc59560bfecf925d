"""Convert Hugging Face models to tensor parallelism in place, by their family's tensor-parallel plan
(plans.py: transformers' own `base_model_tp_plan` for Llama, Mistral, Qwen2, Qwen3, Gemma, GPT-J and
GPT-NeoX; hand-written ones in the same format for GPT-2, GPT-Neo, BERT, RoBERTa and T5), and gather
a TP model's tensors back to the Hugging Face layout.

Per transformer block, Megatron-LM's split (SageMaker reference 003 "Sharded data parallelism with
tensor parallelism", which also distributes the embeddings): the projections into heads / intermediate
features column-parallel, the projections out of them row-parallel (apply_plan.py).

Every embedding sharing the input embedding's weight becomes a VocabParallelEmbedding (T5's shared,
encoder.embed_tokens and decoder.embed_tokens stay one parameter) and the LM head a ColumnParallelLinear
over the vocabulary (tied weights stay tied), whatever the plan says of them. LayerNorm/RMSNorm,
position embeddings and row-parallel biases stay replicated. Each rank copies its slices from TP rank
0's full parameters (broadcast one at a time), so the TP ranks hold one consistent model, equal to TP
rank 0's unconverted one, however they were seeded.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from shardpar.sharding.tp_split import TPSplit
from shardpar.tensor_parallel.apply_plan import apply_plan, column, full_value
from shardpar.tensor_parallel.comm import TPComm
from shardpar.tensor_parallel.layers import TPLayer, VocabParallelEmbedding
from shardpar.tensor_parallel.loss import VocabParallelCausalLMLoss
from shardpar.tensor_parallel.plans import check_styles, family_of, plan_of

Include = Callable[[nn.Module], bool]

# what a config leaves None, and what the model uses then
_DEFAULTS: dict[str, tuple[str, Callable[[Any], int]]] = {
    "n_inner": ("4 x n_embd", lambda c: 4 * int(c.n_embd)),
    "intermediate_size": ("4 x hidden_size", lambda c: 4 * int(c.hidden_size)),
    "num_key_value_heads": ("num_attention_heads", lambda c: int(c.num_attention_heads)),
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _dimension(config: Any, attr: str) -> tuple[str, int]:
    """(how to name it, value) of a config dimension, resolving the HF defaults that are None."""
    value = getattr(config, attr, None)
    if value is not None:
        return attr, int(value)
    if attr in _DEFAULTS:
        means, compute = _DEFAULTS[attr]
        return f"{attr} (None: {means})", compute(config)
    raise ValueError(f"the {config.model_type} config has no {attr}; cannot plan the tensor-parallel split")


def check_tp_divisibility(config: Any, tp: int) -> None:
    """Raise ValueError naming the first dimension of `config` that `tp` TP ranks cannot split."""
    model_type, family = family_of(config, f"a {type(config).__name__}")
    for attr, what in family.divisible:
        label, value = _dimension(config, attr)
        if value % tp:
            raise ValueError(
                f"tensor_parallel_degree={tp} must divide {label}={value} of this {model_type} model: its "
                f"{what} are split across the TP ranks; use a tensor_parallel_degree in {_divisors(value)}"
            )
    if model_type == "gpt2" and getattr(config, "add_cross_attention", False):
        raise ValueError("tensor parallelism does not convert GPT-2 cross-attention (add_cross_attention=True)")


# ---- embeddings ---------------------------------------------------------------------------------


def _replace_everywhere(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Every place `old` is registered (a module may sit under two names) now holds `new`."""
    places = [name for name, m in root.named_modules(remove_duplicate=False) if m is old]
    if not places:
        raise AssertionError(f"{type(old).__name__} not found under {type(root).__name__}")
    for name in places:
        parent_name, _, leaf = name.rpartition(".")
        setattr(root.get_submodule(parent_name), leaf, new)


def _retie(root: nn.Module, old: torch.Tensor | None, new: torch.Tensor | None) -> None:
    """Parameters registered elsewhere as `old` (BERT's cls.predictions.bias is its decoder's bias) are `new`."""
    if old is None or new is None:
        return
    for module in root.modules():
        for name, p in list(module._parameters.items()):
            if p is old:
                module._parameters[name] = new  # type: ignore[assignment]


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


def _embed_scale(emb: nn.Module, what: str) -> torch.Tensor | None:
    """The factor of a scaled embedding (Gemma's GemmaTextScaledWordEmbedding); TypeError for another
    embedding class with a forward of its own, whose behaviour the vocab-parallel lookup would drop."""
    scale = getattr(emb, "embed_scale", None)
    if isinstance(scale, torch.Tensor):
        return scale
    if type(emb).forward is not nn.Embedding.forward:
        raise TypeError(
            f"the {what} is a {type(emb).__name__} with its own forward; tensor parallelism splits a plain "
            "nn.Embedding (or one scaled by embed_scale) only. Use tensor_parallel_degree=1 for this model"
        )
    return None


def _uses_loss_function(model: nn.Module) -> bool:
    # causal LMs compute their loss with self.loss_function (which the vocab-parallel loss replaces);
    # others (BERT's MLM, T5) call CrossEntropyLoss on full logits themselves
    name = type(model).__name__
    return name.endswith("ForCausalLM") or name == "GPT2LMHeadModel"


def _check_embeddings(model: Any, include: Include, vocab_parallel_loss: bool) -> None:
    """Everything _convert_embeddings would refuse, raised before the model changes."""
    emb, head, _ = _embeddings(model)
    if include(emb):
        _embed_scale(emb, "input embedding")
    if head is None or not include(head):
        if vocab_parallel_loss:
            raise ValueError("vocab_parallel_loss=True needs the LM head converted to tensor parallelism")
        return
    if vocab_parallel_loss and not _uses_loss_function(model):
        raise ValueError(
            f"vocab_parallel_loss=True replaces a causal LM's loss_function; {type(model).__name__} computes its "
            "loss on full logits itself. Use vocab_parallel_loss=False (the logits are all-gathered)"
        )
    if type(head).forward is not nn.Linear.forward:
        raise TypeError(
            f"the LM head is a {type(head).__name__} with its own forward; tensor parallelism splits a plain "
            "nn.Linear only (its forward would be lost). Use tensor_parallel_degree=1 for this model"
        )


def _convert_embeddings(model: Any, comm: TPComm, include: Include, vocab_parallel_loss: bool) -> None:
    emb, head, tied = _embeddings(model)
    new_emb: VocabParallelEmbedding | None = None
    if include(emb):
        weight = full_value(emb.weight, comm)
        if weight is None:
            raise AssertionError("input embedding without a weight")
        new_emb = VocabParallelEmbedding(
            weight, comm, padding_idx=emb.padding_idx, embed_scale=_embed_scale(emb, "input embedding")
        )
        # T5: shared, encoder.embed_tokens and decoder.embed_tokens are three modules with one weight
        others = [m for m in model.modules() if m is not emb and getattr(m, "weight", None) is emb.weight]
        _replace_everywhere(model, emb, new_emb)
        for other in others:
            if isinstance(other, nn.Embedding):
                _replace_everywhere(model, other, new_emb)
    if head is None or not include(head):
        return
    new_head = column(head, comm, gather_output=not vocab_parallel_loss)
    _retie(model, head.bias, new_head.bias)
    if tied and new_emb is not None:
        new_head.weight = new_emb.weight  # stay tied: one parameter, one vocabulary split
    _replace_everywhere(model, head, new_head)
    if vocab_parallel_loss:
        model.loss_function = VocabParallelCausalLMLoss(comm)


# config attributes of the dropout on attention probabilities, which runs inside the TP region
# (T5's dropout_rate covers its attention weights too)
_ATTENTION_DROPOUT = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob", "dropout_rate")


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
    model_type, family = family_of(getattr(model, "config", None), type(model).__name__)
    converted = next((name for name, m in model.named_modules() if isinstance(m, TPLayer)), None)
    if converted is not None:
        raise ValueError(
            f"{type(model).__name__} is already tensor parallel ({converted or 'the model'} is a TP layer); "
            "converting again would split the split weights. Convert once: either convert_hf_model, or "
            "smp.DistributedModel(tensor_parallelism=True) / smp.tensor_parallelism(), not both"
        )
    config = model.config
    check_tp_divisibility(config, comm.size)
    plan = plan_of(config, family)
    check_styles(plan, family)
    if not hasattr(model, "get_input_embeddings"):
        raise TypeError(f"{type(model).__name__} has no get_input_embeddings(); pass a Hugging Face model")
    choose = include or (lambda m: True)
    _check_tied_embeddings(model, choose)
    _check_embeddings(model, choose, vocab_parallel_loss)
    _warn_attention_dropout(config, comm.size)
    emb, head, _ = _embeddings(model)
    embeddings = {id(m) for m in model.modules() if m is head or getattr(m, "weight", None) is emb.weight}
    base = getattr(model, "base_model", model)
    if not apply_plan(base, plan, family, comm, choose, skip=lambda m: id(m) in embeddings) and all(
        choose(m) for m in model.modules()
    ):
        raise TypeError(
            f"the {family.label} tensor-parallel plan matched no module of {type(model).__name__} "
            f"(model_type={model_type!r}); nothing to split"
        )
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
