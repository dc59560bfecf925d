"""Tiny Hugging Face models of every family tensor parallelism converts by plan (plans.py), for the
TP parity tests: 4 attention heads (2 key/value heads where the family has grouped-query attention),
widths divisible by tp 2, no dropout, vocabulary 96."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VOCAB = 96
_LLAMA_DIMS = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def _build(config_class: str, model_class: str, seed: int, **kw: Any) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, config_class)(**kw)
    model: nn.Module = getattr(transformers, model_class)(cfg)
    return model


def mistral(seed: int = 0) -> nn.Module:
    return _build("MistralConfig", "MistralForCausalLM", seed, **_LLAMA_DIMS, tie_word_embeddings=False)


def qwen2(seed: int = 0) -> nn.Module:  # q/k/v biases
    return _build("Qwen2Config", "Qwen2ForCausalLM", seed, **_LLAMA_DIMS, tie_word_embeddings=False)


def qwen3(seed: int = 0) -> nn.Module:  # per-head q_norm / k_norm (replicated_with_grad_allreduce), tied
    return _build("Qwen3Config", "Qwen3ForCausalLM", seed, **_LLAMA_DIMS, head_dim=8, tie_word_embeddings=True)


def gemma(seed: int = 0) -> nn.Module:  # tied embeddings scaled by sqrt(hidden), GQA
    return _build("GemmaConfig", "GemmaForCausalLM", seed, **_LLAMA_DIMS, head_dim=8)


def gptj(seed: int = 0) -> nn.Module:  # parallel attention + MLP, rotary on part of each head, LM-head bias
    return _build(
        "GPTJConfig", "GPTJForCausalLM", seed, vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
        n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip


def gpt_neo(seed: int = 0) -> nn.Module:  # a global and a local-attention layer
    return _build(
        "GPTNeoConfig", "GPTNeoForCausalLM", seed, vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
        attention_types=[[["global", "local"], 1]], window_size=8, max_position_embeddings=64,
        embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0,
    )  # fmt: skip


_BERT_DIMS = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 48,
    "max_position_embeddings": 64,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}


def bert(seed: int = 0) -> nn.Module:  # post-norm; MLM decoder tied to the word embeddings, its bias to cls
    return _build("BertConfig", "BertForMaskedLM", seed, **_BERT_DIMS)


def roberta(seed: int = 0) -> nn.Module:  # padding_idx 1 in the vocab-parallel embedding
    return _build("RobertaConfig", "RobertaForMaskedLM", seed, **_BERT_DIMS)


def t5(seed: int = 0) -> nn.Module:  # encoder-decoder, relative attention bias per head, 3 tied embeddings
    return _build(
        "T5Config", "T5ForConditionalGeneration", seed, vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48,
        num_layers=2, num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0,
    )  # fmt: skip


def t5_gated(seed: int = 0) -> nn.Module:  # Flan-T5's gated-GELU feed-forward (wi_0, wi_1), untied head
    return _build(
        "T5Config", "T5ForConditionalGeneration", seed, vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48,
        num_layers=2, num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False,
    )  # fmt: skip


FAMILY_BUILDERS: dict[str, Callable[[int], nn.Module]] = {
    "mistral": mistral,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "gemma": gemma,
    "gptj": gptj,
    "gpt_neo": gpt_neo,
    "bert": bert,
    "roberta": roberta,
    "t5": t5,
    "t5_gated": t5_gated,
}


def family_batch(seed: int, rows: int, seq: int = 12) -> dict[str, torch.Tensor]:
    """input_ids and labels (the ids: a causal LM shifts them, an MLM / T5 predicts them as they are);
    ids from 2 up, so RoBERTa's padding id 1 never appears."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (rows, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
