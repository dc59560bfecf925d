"""Pure parts of tensor parallelism: split math, HF divisibility errors, context marks, the data helper,
and the HF conversion's structure (one simulated rank group of 2, no processes)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from shardpar.api.data import rdp_slice
from shardpar.collectives import Group, NativeEngine
from shardpar.tensor_parallel import (
    ColumnParallelLinear,
    ModuleMarks,
    RowParallelLinear,
    TPComm,
    TPOptions,
    TPSplit,
    VocabParallelEmbedding,
    check_tp_divisibility,
    convert_hf_model,
    full_shapes,
    shard_full_state_dict,
    tp_split_table,
)

transformers = pytest.importorskip("transformers")


# ---- split math ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("dim", "parts", "size"), [(0, 1, 2), (1, 1, 4), (1, 3, 2), (0, 3, 4), (0, 1, 1)])
def test_split_round_trip(dim: int, parts: int, size: int) -> None:
    full = torch.arange(24 * 12, dtype=torch.float32).view(24, 12)
    split = TPSplit(dim=dim, size=size, num_parts=parts)
    pieces = [split.local_of(full, r) for r in range(size)]
    assert all(p.shape[dim] == full.shape[dim] // size for p in pieces)
    assert torch.equal(split.full_of(pieces), full)
    assert split.full_shape(pieces[0].shape) == tuple(full.shape)


def test_fused_parts_give_each_rank_its_heads_of_q_k_and_v() -> None:
    full = torch.tensor([0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23])  # [q | k | v], 4 heads each
    split = TPSplit(dim=0, size=2, num_parts=3)
    assert split.local_of(full, 0).tolist() == [0, 1, 10, 11, 20, 21]
    assert split.local_of(full, 1).tolist() == [2, 3, 12, 13, 22, 23]


def test_split_rejects_uneven_dims() -> None:
    with pytest.raises(ValueError, match=r"9 entries, not divisible by tensor_parallel_degree 2 x 3 fused parts"):
        TPSplit(dim=0, size=2, num_parts=3).local_of(torch.zeros(9), 0)


def test_shard_and_shapes_of_a_state_dict() -> None:
    splits = {"w": TPSplit(dim=1, size=2), "b": TPSplit(dim=0, size=2)}
    sd = {"w": torch.arange(12.0).view(3, 4), "b": torch.arange(4.0), "norm": torch.ones(3)}
    local = shard_full_state_dict(sd, splits, 1)
    assert local["w"].tolist() == [[2, 3], [6, 7], [10, 11]] and local["b"].tolist() == [2, 3]
    assert local["norm"] is sd["norm"]
    shapes = full_shapes({k: tuple(v.shape) for k, v in local.items()}, splits)
    assert shapes == {"w": (3, 4), "b": (4,), "norm": (3,)}


# ---- Hugging Face: what must divide tp ------------------------------------------------------------


def _neox_cfg(**kw: int) -> object:
    base = {"vocab_size": 96, "hidden_size": 48, "num_attention_heads": 4, "intermediate_size": 64}
    return transformers.GPTNeoXConfig(**{**base, **kw})


@pytest.mark.parametrize(
    ("config", "tp", "message"),
    [
        (lambda: _neox_cfg(num_attention_heads=3), 2, r"num_attention_heads=3 .* attention heads .* \[1, 3\]"),
        (lambda: _neox_cfg(intermediate_size=66), 4, r"intermediate_size=66 .* MLP intermediate"),
        (lambda: _neox_cfg(vocab_size=98), 4, r"vocab_size=98 .* vocabulary rows"),
        (
            lambda: transformers.LlamaConfig(
                hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=64
            ),
            4,
            r"num_key_value_heads=2 .*grouped-query.* \[1, 2\]",
        ),
        (lambda: transformers.GPT2Config(n_embd=30, n_head=2, vocab_size=64), 4, r"n_head=2"),
        (lambda: transformers.GPT2Config(n_embd=32, n_head=4, n_inner=30, vocab_size=64), 4, r"n_inner=30"),
    ],
)
def test_indivisible_dimensions_are_named(config: object, tp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_tp_divisibility(config(), tp)  # type: ignore[operator]


def test_divisible_models_pass_and_other_models_are_refused() -> None:
    check_tp_divisibility(_neox_cfg(), 4)
    check_tp_divisibility(transformers.LlamaConfig(num_attention_heads=8, num_key_value_heads=2, vocab_size=64), 2)
    check_tp_divisibility(transformers.BertConfig(), 2)  # v1 split BERT; a hand-written plan here
    # a model without a plan is refused naming the families that have one
    with pytest.raises(TypeError, match=r"GPT-J \(gptj\).*T5 \(t5\); got a OPTConfig \(model_type='opt'\): it has no"):
        check_tp_divisibility(transformers.OPTConfig(), 2)
    # transformers ships a plan for Phi-3, but its fused qkv_proj / gate_up_proj layouts are not verified here
    with pytest.raises(TypeError, match=r"model_type='phi3'\): transformers ships a tensor-parallel plan"):
        check_tp_divisibility(transformers.Phi3Config(), 2)
    with pytest.raises(ValueError, match="cross-attention"):
        check_tp_divisibility(transformers.GPT2Config(n_head=4, add_cross_attention=True, vocab_size=64), 2)


# ---- conversion structure (TP group of 1 needs no peers; of 2, only the shapes are checked) ----------


def _comm(size: int = 1, rank: int = 0) -> TPComm:
    return TPComm(NativeEngine(), Group("tp", tuple(range(size))), rank)


def _tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _tiny_gpt2(**kw: float) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=64, **{"attn_pdrop": 0.0, **kw})
    return transformers.GPT2LMHeadModel(cfg)


def test_llama_conversion_keeps_hf_names_and_splits_the_right_dims() -> None:
    model = _tiny_llama()
    names = [n for n, _ in model.named_parameters()]
    convert_hf_model(model, _comm(2, 1))
    assert [n for n, _ in model.named_parameters()] == names
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.k_proj, ColumnParallelLinear) and layer.self_attn.k_proj.weight.shape == (8, 32)
    assert isinstance(layer.self_attn.o_proj, RowParallelLinear) and layer.self_attn.o_proj.weight.shape == (32, 16)
    assert isinstance(model.model.embed_tokens, VocabParallelEmbedding)
    assert model.model.embed_tokens.vocab_start == 32 and model.lm_head.weight.shape == (32, 32)
    splits = tp_split_table(model)
    assert "model.layers.0.input_layernorm.weight" not in splits
    assert splits["model.layers.1.mlp.down_proj.weight"] == TPSplit(dim=1, size=2)
    assert splits["lm_head.weight"] == TPSplit(dim=0, size=2)


def test_tied_gpt2_stays_tied_and_fused_qkv_uses_parts() -> None:
    model = _tiny_gpt2()
    convert_hf_model(model, _comm(2, 0))
    assert model.lm_head.weight is model.transformer.wte.weight
    attn = model.transformer.h[0].attn
    assert attn.c_attn.weight.shape == (32, 48) and attn.split_size == 16 and attn.num_heads == 2
    assert tp_split_table(model)["transformer.h.0.attn.c_attn.bias"] == TPSplit(dim=0, size=2, num_parts=3)


def test_tp_group_of_one_changes_nothing_numerically() -> None:
    model, ref = _tiny_llama(), _tiny_llama()
    convert_hf_model(model, _comm(1, 0), vocab_parallel_loss=True)
    ids = torch.randint(0, 64, (2, 7))
    out, expected = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    assert torch.allclose(out.logits, expected.logits, atol=1e-6)
    assert abs(out.loss.item() - expected.loss.item()) < 1e-6


def test_conversion_refuses_meta_and_foreign_models() -> None:
    with torch.device("meta"):
        meta = _tiny_llama()
    with pytest.raises(ValueError, match="meta device"):
        convert_hf_model(meta, _comm())
    with pytest.raises(TypeError, match=r"Llama \(llama\), Mistral \(mistral\).*; got Linear \(model_type=None\)"):
        convert_hf_model(nn.Linear(2, 2), _comm())


# ---- smp.tensor_parallelism() marks ------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)


def test_context_marks_modules_and_nested_disable_wins() -> None:
    marks = ModuleMarks()
    on, off = TPOptions(), TPOptions(enabled=False)
    with marks.building(on):
        root = nn.Sequential(_Block(), _Block())
        with marks.building(off):
            root.append(_Block())
    outside = _Block()
    eff = marks.resolve(root, None)
    assert eff[id(root)] == on and eff[id(root[0].lin)] == on
    assert eff[id(root[2])] == off and eff[id(root[2].lin)] == off
    assert marks.resolve(outside, None)[id(outside.lin)] is None
    assert marks.resolve(outside, on)[id(outside.lin)] == on  # tensor_parallelism=True default
    assert marks._handle is None  # the global registration hook is gone after the context


# ---- prescaled batch ------------------------------------------------------------------------------


def test_rdp_slice_gives_each_tp_group_its_rows() -> None:
    batch = {"input_ids": torch.arange(8).view(4, 2), "meta": "kept", "pair": (torch.arange(4), torch.arange(4))}
    part = rdp_slice(batch, rdp_rank=1, rdp_size=2)
    assert part["input_ids"].tolist() == [[4, 5], [6, 7]] and part["meta"] == "kept"
    assert part["pair"][1].tolist() == [2, 3]
    with pytest.raises(ValueError, match=r"rdp_size=3 .* multiple of 3"):
        rdp_slice(batch, rdp_rank=0, rdp_size=3)
    with pytest.raises(ValueError, match="rdp_rank=2"):
        rdp_slice(batch, rdp_rank=2, rdp_size=2)


def test_a_converted_model_is_not_converted_again() -> None:
    model = convert_hf_model(_tiny_llama(), _comm(2, 0))
    with pytest.raises(ValueError, match=r"already tensor parallel \(model\.embed_tokens is a TP layer\)"):
        convert_hf_model(model, _comm(2, 0))
    assert model.model.embed_tokens.weight.shape == (32, 32)  # not split twice


def test_tied_embeddings_split_on_one_side_only_are_refused_before_any_change() -> None:
    """A tied weight cannot be split for the embedding and replicated for the LM head: the tie would
    silently break and the two copies train apart."""
    for keep in ("lm_head", "wte"):
        model = _tiny_gpt2()
        shapes = {n: p.shape for n, p in model.named_parameters()}
        skip = model.lm_head if keep == "lm_head" else model.transformer.wte
        with pytest.raises(ValueError, match=r"share one weight \(tied word embeddings\)"):
            convert_hf_model(model, _comm(2, 0), include=lambda m, skip=skip: m is not skip)  # type: ignore[misc]
        assert {n: p.shape for n, p in model.named_parameters()} == shapes
        assert not any(isinstance(m, ColumnParallelLinear) for m in model.modules())


def test_attention_dropout_under_tensor_parallelism_warns() -> None:
    """Each TP rank draws the same dropout masks for its own heads (no per-TP-rank RNG stream)."""
    with pytest.warns(UserWarning, match=r"attn_pdrop=0\.1 with tensor_parallel_degree=2: .* same random stream"):
        convert_hf_model(_tiny_gpt2(attn_pdrop=0.1), _comm(2, 0))
    with pytest.warns(UserWarning, match=r"attention_dropout=0\.2"):
        model = _tiny_llama()
        model.config.attention_dropout = 0.2
        convert_hf_model(model, _comm(2, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_hf_model(_tiny_gpt2(), _comm(2, 0))  # no dropout: no warning
