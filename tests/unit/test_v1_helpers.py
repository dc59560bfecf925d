"""SageMaker model-parallel v1's small helpers (issue 22, item 6): smp.nn.FusedLayerNorm,
smp.memory_metrics() and the shardpar.nn.huggingface translation modules."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch
import transformers
from torch import nn

import shardpar as smp
from tests import models


def test_fused_layer_norm_is_layer_norm() -> None:
    torch.manual_seed(0)
    fused, plain = smp.nn.FusedLayerNorm(24, eps=1e-6), nn.LayerNorm(24, eps=1e-6)
    with torch.no_grad():
        fused.weight.normal_()
        fused.bias.normal_()
        plain.load_state_dict(fused.state_dict())
    x = torch.randn(3, 5, 24)
    assert torch.equal(fused(x), plain(x))
    assert set(fused.state_dict()) == {"weight", "bias"}
    assert isinstance(fused, nn.LayerNorm)


def _tiny(family: str) -> nn.Module:
    torch.manual_seed(0)
    small = {"vocab_size": 64}
    if family == "gpt2":
        return models.tiny_gpt2_tied()
    if family == "gptneox":
        return models.tiny_neox()
    if family == "gptj":
        cfg = transformers.GPTJConfig(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32, **small)
        return transformers.GPTJForCausalLM(cfg)
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, **small
    )
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("family", ["gpt2", "gptneox", "gptj", "llama"])
def test_hf_translations_round_trip(family: str) -> None:
    mod = importlib.import_module(f"shardpar.nn.huggingface.{family}")
    to_smp = getattr(mod, f"translate_hf_state_dict_to_smdistributed_{family}")
    to_hf = getattr(mod, f"translate_state_dict_to_hf_{family}")
    model = _tiny(family).eval()
    state = model.state_dict()
    there = to_smp(state, max_seq_len=32)  # v1 scripts pass extra arguments
    back = to_hf(there)
    assert there is not state and list(back) == list(state)
    fresh = _tiny(family).eval()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)  # so that loading is what makes the logits equal
    fresh.load_state_dict(back, strict=True)
    ids = torch.arange(12).view(2, 6) % 60
    assert torch.equal(fresh(input_ids=ids).logits, model(input_ids=ids).logits)
    with pytest.raises(TypeError, match="takes a state dict"):
        to_hf([1, 2])


def test_memory_metrics_reads_this_process(world_of_one: None, caplog: pytest.LogCaptureFixture) -> None:
    big = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB resident: the reading must see it
    with caplog.at_level(logging.WARNING, logger="shardpar"):
        m = smp.memory_metrics()
    assert set(m) == {"rss", "peak_rss"}
    assert m["peak_rss"] >= m["rss"] >= 64
    assert "rank 0 memory (cpu): rss" in caplog.text
    assert smp.memory_metrics(log=False).keys() == m.keys()
    del big
