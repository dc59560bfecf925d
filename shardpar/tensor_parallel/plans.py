"""Which layers of each Hugging Face model family are split, as tensor-parallel plans in transformers'
own format: `{"layers.*.self_attn.q_proj": "colwise", ...}`, module paths relative to the base model
(`model.base_model`), `*` standing for a layer number.

Where transformers ships a plan (`base_model_tp_plan` on the config class: Llama, Mistral, Qwen2,
Qwen3, Gemma, GPT-J, GPT-NeoX in transformers 5.x) that plan is read from the config; for the families
SageMaker v1 supported without one there (GPT-2, GPT-Neo, BERT, RoBERTa, T5) the table below holds a
hand-written one. The input embedding and the LM head are not plan entries here: every family's
become vocab-parallel (hf.py), as reference 003 distributes the embeddings.

Beside the plan, a family may name
  * `local_heads`: attention modules whose attributes count heads or head widths, divided by tp on
    conversion because their forward reshapes with them (GPT-2's split_size; modules that reshape
    with -1 need nothing);
  * `shared_inputs`: a norm whose output is read ONLY by the listed column-parallel siblings (Llama's
    input_layernorm -> q/k/v). One copy_to_tp region on the norm's output then all-reduces their
    summed input gradient once, instead of once per projection. Never for an input that is also the
    residual (BERT, post-norm): the region's backward would sum the residual's gradient tp times.
  * `divisible`: the config dimensions that tensor_parallel_degree must divide.

Styles (transformers' names; the last two are shardpar's, for layouts transformers does not plan):
    colwise                  ColumnParallelLinear: output features split, input replicated
    colwise_rep, colwise_gather_output   the same, output all-gathered
    packed_colwise           output = [gate | up] fused: each half split (TPSplit num_parts 2)
    rowwise                  RowParallelLinear: input features split, output all-reduced, bias once
    embedding_rowwise        VocabParallelEmbedding: rows split, lookups summed
    replicated_with_grad_allreduce   replicated weight of a per-head norm (Qwen3's q_norm): its
                             gradient covers this rank's heads only, so it is summed over the TP group
    replicate                nothing to do
    colwise_qkv              output = [q | k | v] fused (GPT-2's c_attn): each third split by heads
    embedding_heads          an embedding whose columns are heads (T5's relative_attention_bias):
                             columns split, output kept local like a colwise layer's
Any other style (sequence_parallel, rowwise_rep, embedding_colwise, moe_*, ...) is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_STYLES = (
    "colwise",
    "colwise_rep",
    "colwise_gather_output",
    "packed_colwise",
    "rowwise",
    "embedding_rowwise",
    "replicated_with_grad_allreduce",
    "replicate",
    "colwise_qkv",
    "embedding_heads",
)


@dataclass(frozen=True)
class Family:
    label: str  # as users name it, for messages
    plan: Mapping[str, str] | None  # None: transformers' config.base_model_tp_plan
    divisible: tuple[tuple[str, str], ...]
    local_heads: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    shared_inputs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


_HEADS = "attention heads"
_MLP = "MLP intermediate features"
_VOCAB = ("vocab_size", "vocabulary rows")

# Llama and the families built on its decoder layer: pre-norm, so each norm feeds only its projections
_LLAMA_LIKE = Family(
    label="Llama",
    plan=None,
    divisible=(
        ("num_attention_heads", _HEADS),
        ("num_key_value_heads", "key/value heads (grouped-query attention)"),
        ("intermediate_size", _MLP),
        _VOCAB,
    ),
    shared_inputs={
        "layers.*.input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "layers.*.post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
    },
)


def _like_llama(label: str) -> Family:
    return Family(label, None, _LLAMA_LIKE.divisible, shared_inputs=_LLAMA_LIKE.shared_inputs)


def _bert_like(label: str) -> Family:
    return Family(
        label=label,
        plan={
            "encoder.layer.*.attention.self.query": "colwise",
            "encoder.layer.*.attention.self.key": "colwise",
            "encoder.layer.*.attention.self.value": "colwise",
            "encoder.layer.*.attention.output.dense": "rowwise",
            "encoder.layer.*.intermediate.dense": "colwise",
            "encoder.layer.*.output.dense": "rowwise",
        },
        divisible=(("num_attention_heads", _HEADS), ("intermediate_size", _MLP), _VOCAB),
        local_heads={"encoder.layer.*.attention.self": ("num_attention_heads", "all_head_size")},
    )


def _t5_plan() -> dict[str, str]:
    plan: dict[str, str] = {}
    for stack in ("encoder", "decoder"):
        for attention in ("SelfAttention", "EncDecAttention"):
            prefix = f"{stack}.block.*.layer.*.{attention}"
            plan.update({f"{prefix}.{p}": "colwise" for p in ("q", "k", "v")})
            plan[f"{prefix}.o"] = "rowwise"
            plan[f"{prefix}.relative_attention_bias"] = "embedding_heads"  # [buckets, heads]
        for wi in ("wi", "wi_0", "wi_1"):  # T5DenseActDense / T5DenseGatedActDense
            plan[f"{stack}.block.*.layer.*.DenseReluDense.{wi}"] = "colwise"
        plan[f"{stack}.block.*.layer.*.DenseReluDense.wo"] = "rowwise"
    return plan


FAMILIES: dict[str, Family] = {
    "llama": _LLAMA_LIKE,
    "mistral": _like_llama("Mistral"),
    "qwen2": _like_llama("Qwen2"),
    "qwen3": _like_llama("Qwen3"),
    "gemma": _like_llama("Gemma"),
    # query_key_value's rows are grouped per head ([q k v] x heads): a plain colwise cut keeps whole
    # heads, as transformers' plan says
    "gpt_neox": Family("GPT-NeoX", None, (("num_attention_heads", _HEADS), ("intermediate_size", _MLP), _VOCAB)),
    "gptj": Family("GPT-J", None, (("n_head", _HEADS), ("n_inner", _MLP), _VOCAB)),
    "gpt2": Family(
        label="GPT-2",
        plan={
            "h.*.attn.c_attn": "colwise_qkv",  # Conv1D [q | k | v]: a plain cut would give rank 0 all of q
            "h.*.attn.c_proj": "rowwise",
            "h.*.mlp.c_fc": "colwise",
            "h.*.mlp.c_proj": "rowwise",
        },
        divisible=(("n_head", _HEADS), ("n_inner", _MLP), _VOCAB),
        local_heads={"h.*.attn": ("num_heads", "split_size", "embed_dim")},  # split(self.split_size)
    ),
    "gpt_neo": Family(
        label="GPT-Neo",
        plan={
            "h.*.attn.attention.q_proj": "colwise",
            "h.*.attn.attention.k_proj": "colwise",
            "h.*.attn.attention.v_proj": "colwise",
            "h.*.attn.attention.out_proj": "rowwise",
            "h.*.mlp.c_fc": "colwise",
            "h.*.mlp.c_proj": "rowwise",
        },
        divisible=(("num_heads", _HEADS), ("intermediate_size", _MLP), _VOCAB),
        local_heads={"h.*.attn.attention": ("num_heads",)},  # _split_heads(x, self.num_heads, ...)
    ),
    "bert": _bert_like("BERT"),
    "roberta": _bert_like("RoBERTa"),
    "t5": Family(
        label="T5",
        plan=_t5_plan(),
        divisible=(("num_heads", _HEADS), ("d_ff", "feed-forward features (d_ff)"), _VOCAB),
        local_heads={
            f"{stack}.block.*.layer.*.{attention}": ("n_heads", "inner_dim")
            for stack in ("encoder", "decoder")
            for attention in ("SelfAttention", "EncDecAttention")
        },
    ),
}


def family_names() -> str:
    return ", ".join(f"{f.label} ({t})" for t, f in FAMILIES.items())


def family_of(config: Any, what: str) -> tuple[str, Family]:
    """(model_type, Family) of a Hugging Face config; TypeError naming the families otherwise."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        has_plan = bool(getattr(config, "base_model_tp_plan", None))
        why = (
            "transformers ships a tensor-parallel plan for it, but shardpar has not verified that family's "
            "layouts (fused projections, head attributes) yet"
            if has_plan
            else "it has no tensor-parallel plan"
        )
        raise TypeError(
            f"tensor parallelism converts Hugging Face models of these families: {family_names()}; got {what} "
            f"(model_type={model_type!r}): {why}. Use tensor_parallel_degree=1 for it, or one of those families"
        )
    return str(model_type), FAMILIES[model_type]


def plan_of(config: Any, family: Family) -> dict[str, str]:
    """The family's plan: its own, or the one transformers ships on the config (a copy)."""
    if family.plan is not None:
        return dict(family.plan)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise TypeError(
            f"this transformers version ships no base_model_tp_plan for {family.label} "
            f"({type(config).__name__}); tensor parallelism reads the plan from there (transformers >= 4.50)"
        )
    return dict(plan)


def check_styles(plan: Mapping[str, str], family: Family) -> None:
    """Refuse, before anything changes, a plan style whose meaning shardpar does not implement exactly."""
    for pattern, style in plan.items():
        if style not in SUPPORTED_STYLES:
            raise ValueError(
                f"the {family.label} tensor-parallel plan splits {pattern!r} with style {style!r}, which shardpar "
                f"does not implement; supported styles: {', '.join(SUPPORTED_STYLES)}. Override the entry in "
                f"config.base_model_tp_plan with one of those, or use tensor_parallel_degree=1"
            )


def pattern_of(path: str) -> str:
    """A module path with its layer numbers as `*`, as the plans write them ("layers.3.mlp" -> "layers.*.mlp")."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))
