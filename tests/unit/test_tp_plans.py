"""Tensor parallelism from each family's plan (tensor_parallel/plans.py): what is split, what is refused
before anything changes (one simulated TP group of 2, no processes; numbers are test_tp_families.py's)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardpar.collectives import Group, NativeEngine
from shardpar.tensor_parallel import (
    FAMILIES,
    ColumnParallelLinear,
    HeadParallelEmbedding,
    RowParallelLinear,
    TPComm,
    TPSplit,
    VocabParallelEmbedding,
    check_tp_divisibility,
    convert_hf_model,
    tp_split_table,
)
from tests import tp_families

transformers = pytest.importorskip("transformers")


def _comm(rank: int = 0) -> TPComm:
    return TPComm(NativeEngine(), Group("tp", (0, 1)), rank)


def _shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_the_plans_of_transformers_are_read_from_the_config() -> None:
    """Llama, Mistral, Qwen2/3, Gemma, GPT-J, GPT-NeoX: no plan of our own; the others hand-written."""
    from_transformers = sorted(t for t, f in FAMILIES.items() if f.plan is None)
    assert from_transformers == ["gemma", "gpt_neox", "gptj", "llama", "mistral", "qwen2", "qwen3"]
    for model_type in from_transformers:
        assert transformers.CONFIG_MAPPING[model_type].base_model_tp_plan, model_type


def test_qwen3_splits_heads_and_sums_the_per_head_norm_gradients() -> None:
    model = convert_hf_model(tp_families.qwen3(), _comm(1))
    att = model.model.layers[0].self_attn
    assert isinstance(att.q_proj, ColumnParallelLinear) and att.q_proj.weight.shape == (16, 32)  # 2 of 4 heads
    assert isinstance(att.o_proj, RowParallelLinear) and att.o_proj.weight.shape == (32, 16)
    assert att.q_norm.weight.shape == (8,) and "summed_forward" in att.q_norm.forward.__name__
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, one vocabulary split
    # an attention kept whole (smp.tensor_parallelism(enabled=False)): its norms see every head, nothing summed
    model = tp_families.qwen3()
    kept = {id(m) for m in model.model.layers[0].self_attn.modules()}
    convert_hf_model(model, _comm(1), include=lambda m: id(m) not in kept)
    att0, att1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    assert type(att0.q_proj) is nn.Linear and "summed_forward" not in att0.q_norm.forward.__name__
    assert isinstance(att1.q_proj, ColumnParallelLinear) and "summed_forward" in att1.k_norm.forward.__name__


def test_t5_splits_heads_of_the_relative_bias_and_keeps_its_three_embeddings_one() -> None:
    model = convert_hf_model(tp_families.t5(), _comm(1))
    first = model.encoder.block[0].layer[0].SelfAttention
    assert isinstance(first.relative_attention_bias, HeadParallelEmbedding)
    assert first.relative_attention_bias.weight.shape == (8, 2) and first.n_heads == 2 and first.inner_dim == 16
    assert model.decoder.block[1].layer[1].EncDecAttention.n_heads == 2
    emb = model.shared
    assert isinstance(emb, VocabParallelEmbedding)
    assert model.encoder.embed_tokens is emb and model.decoder.embed_tokens is emb
    assert model.lm_head.weight is emb.weight
    splits = tp_split_table(model)
    assert splits["encoder.embed_tokens.weight"] == TPSplit(dim=0, size=2)
    assert splits["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] == TPSplit(dim=1, size=2)


def test_bert_mlm_bias_stays_tied_to_the_split_decoder_and_is_in_the_split_table() -> None:
    model = convert_hf_model(tp_families.bert(), _comm(0))
    head = model.cls.predictions
    assert head.bias is head.decoder.bias and head.bias.shape == (48,)
    assert tp_split_table(model)["cls.predictions.bias"] == TPSplit(dim=0, size=2)
    assert model.bert.encoder.layer[0].attention.self.num_attention_heads == 2


def test_gemma_keeps_its_embedding_scale() -> None:
    model = convert_hf_model(tp_families.gemma(), _comm(0))
    emb = model.model.embed_tokens
    assert isinstance(emb, VocabParallelEmbedding) and emb.embed_scale is not None
    assert emb.embed_scale.item() == pytest.approx(32**0.5)


def test_a_style_shardpar_does_not_implement_is_refused_before_any_change() -> None:
    model = tp_families.mistral()
    model.config.base_model_tp_plan = {
        **model.config.base_model_tp_plan,
        "layers.*.input_layernorm": "sequence_parallel",
    }
    shapes = _shapes(model)
    with pytest.raises(ValueError, match=r"'layers\.\*\.input_layernorm' with style 'sequence_parallel', .* supported"):
        convert_hf_model(model, _comm())
    assert _shapes(model) == shapes


def test_grouped_query_attention_with_fewer_kv_heads_than_tp_is_refused() -> None:
    for config in (
        transformers.Qwen2Config(num_attention_heads=4, num_key_value_heads=1, hidden_size=32, vocab_size=96),
        transformers.GemmaConfig(num_attention_heads=4, num_key_value_heads=1, head_dim=8, vocab_size=96),
    ):
        with pytest.raises(ValueError, match=r"num_key_value_heads=1 .*grouped-query.* in \[1\]"):
            check_tp_divisibility(config, 2)


def test_the_vocab_parallel_loss_is_refused_where_the_model_computes_its_own_loss() -> None:
    model = tp_families.bert()
    shapes = _shapes(model)
    with pytest.raises(ValueError, match=r"BertForMaskedLM computes its loss on full logits itself"):
        convert_hf_model(model, _comm(), vocab_parallel_loss=True)
    assert _shapes(model) == shapes


def test_an_lm_head_with_a_forward_of_its_own_is_refused() -> None:
    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    model = tp_families.gptj()
    old = model.lm_head
    model.lm_head = Scaled(old.in_features, old.out_features)
    shapes = _shapes(model)
    with pytest.raises(TypeError, match="the LM head is a Scaled with its own forward"):
        convert_hf_model(model, _comm())
    assert _shapes(model) == shapes  # refused before any block was split
