"""smp.set_activation_checkpointing on Hugging Face layers called with a key/value cache (issue 30 item 6):
T5 with use_cache=True (its config's default) died in torch's CheckpointError, since the recomputation
appended to the cache the forward had filled. The recomputation now runs without it ([Note: caches in a
recomputation]): gradients equal an uncheckpointed run's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardpar as smp
from tests.conftest import init_world_of_one


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
        use_cache=True, decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0,
    )  # fmt: skip
    return T5ForConditionalGeneration(cfg)


def _grads(strategy: str | None, wrap: bool) -> dict[str, torch.Tensor]:
    module = _t5()
    if strategy is not None:
        for blocks in (module.encoder.block, module.decoder.block):
            smp.set_activation_checkpointing(blocks, strategy=strategy)
    model = smp.DistributedModel(module) if wrap else module
    g = torch.Generator().manual_seed(1)
    loss = model(
        input_ids=torch.randint(1, 64, (2, 8), generator=g), labels=torch.randint(1, 64, (2, 5), generator=g)
    ).loss
    loss.backward()
    # wrapped, in a world of one: each user parameter's grad is a ShardedTensor holding the whole gradient
    return {n: (p.grad.local_piece if wrap else p.grad).reshape(p.shape).clone()
            for n, p in model.named_parameters() if p.grad is not None}  # fmt: skip


@pytest.mark.parametrize(("strategy", "wrap"), [("each", True), ("group_2", False)])
def test_t5_with_use_cache_trains_under_activation_checkpointing(
    monkeypatch: pytest.MonkeyPatch, strategy: str, wrap: bool
) -> None:
    """Both recomputation paths: torch's checkpoint ('each', here under smp.DistributedModel, whose units
    gather again in the recomputation) and the group frame ('group_2')."""
    with init_world_of_one(monkeypatch):
        plain = _grads(None, wrap=False)
        checkpointed = _grads(strategy, wrap=wrap)
    assert plain.keys() == checkpointed.keys() and len(plain) > 10
    assert all(torch.allclose(plain[n], checkpointed[n], atol=1e-6) for n in plain), max(
        (plain[n] - checkpointed[n]).abs().max().item() for n in plain
    )
