"""`shardpar estimate --lora-rank R --frozen-dtype ...` (issue 33): the LoRA model-state and checkpoint
arithmetic (cli/lora_estimate.py) against what a wrapped PEFT model holds and writes (world of one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardpar as smp
from shardpar.checkpoint.safetensors_io import tensor_nbytes
from shardpar.cli import lora_estimate as lora
from shardpar.cli.main import main
from shardpar.cli.model_shape import shape_from_module
from tests import models
from tests.conftest import init_world_of_one
from tests.multiproc.adapter_ckpt_cases import TARGETS
from tests.multiproc.frozen_cases import lora as peft_lora

THRESHOLD = 1000


def test_lora_estimate_counts_what_a_wrapped_peft_model_holds_and_saves(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    base = models.tiny_neox(0, layers=2).to(torch.bfloat16)
    shape = shape_from_module(base, persistence_threshold=THRESHOLD)
    e = lora.estimate_lora(shape, rank=4, sdp=1, frozen_dtype="bf16", persistence_threshold=THRESHOLD)
    with init_world_of_one(monkeypatch, sdp_param_persistence_threshold=THRESHOLD, bf16=True):
        model = smp.DistributedModel(peft_lora(base, TARGETS))
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        assert e.adapter_numel == sum(p.numel() for p in model.parameters() if p.requires_grad)
        shards = [u.frozen.shard for u in model.units if u.frozen is not None]
        held = sum(s.numel() * s.element_size() for s in shards)
        assert e.frozen_sharded <= held <= e.frozen_sharded + 64 * len(shards)  # a few elements of padding
        # the base's small tensors (layer norms, biases: under the threshold) are in those shards, in bf16:
        # only trained parameters persist (no fp32 main, compute copy or grad for a frozen one)
        small_frozen = [p for p in base.parameters() if not p.requires_grad and p.numel() < THRESHOLD]
        assert small_frozen and all(p.requires_grad for p in model.persistent.params)
        assert all(s.dtype == torch.bfloat16 for s in shards)
        ids = torch.randint(0, 96, (2, 8))
        model.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        smp.save_checkpoint(tmp_path, "t", model=model, optimizer=opt)
        index = json.loads((tmp_path / "t_partial" / "index.json").read_text())
    written = sum(
        tensor_nbytes(dtype, shape)
        for entry in index["files"].values()
        for key, (dtype, shape) in entry["tensors"].items()
        if key.startswith(("param/", "optim/"))
    )
    fingerprint = e.checkpoint_adapter_only - written
    assert 0 < fingerprint <= 16 << 10, (e.checkpoint_adapter_only, written)  # the adapters and Adam, exactly
    assert len(index["frozen"]) * 100 <= fingerprint  # ... plus the index's per-tensor fingerprint


def test_quantized_frozen_base_is_modelled_per_64_value_block() -> None:
    shape = models_shape = shape_from_module(models.tiny_neox(0, layers=2), persistence_threshold=0)
    del models_shape
    sizes = {
        d: lora.estimate_lora(shape, rank=16, sdp=4, frozen_dtype=d, persistence_threshold=0) for d in lora.FROZEN_BYTES
    }
    base = sum((n + 3) // 4 for n in shape.unit_numels)
    # int8 / nf4 store the codes only: the exact bf16 shard is dropped once quantized (runtime/frozen_exact.py)
    assert sizes["bf16"].frozen_sharded == 2 * base and sizes["bf16"].frozen_codes == 0
    assert sizes["int8"].frozen_sharded == sizes["nf4"].frozen_sharded == 0
    assert sizes["int8"].frozen_codes == -(-base * 17 // 16)  # 1 byte + a 4-byte scale per 64 values
    assert sizes["nf4"].frozen_codes == -(-base * 9 // 16)  # half a byte + the scale
    assert sizes["int8"].adapter_states == sizes["bf16"].adapter_states > 0


def test_quantized_base_keeps_only_its_1d_tensors_whole() -> None:
    """Under int8 / nf4 the small frozen matrices (under the threshold) are quantized with the shard; only
    biases and layer norms stay whole: a GPT-NeoX block's 9 x hidden + MLP width, the final norm's 2 x hidden."""
    shape = shape_from_module(models.tiny_neox(0, layers=2), persistence_threshold=int(1e6))
    h, f = shape.hidden, lora.mlp_width(shape)
    assert shape.persistent_numel > 2 * (9 * h + f) + 2 * h  # the tiny model's weights are all under 1e6
    e = lora.estimate_lora(shape, rank=4, sdp=2, frozen_dtype="int8", persistence_threshold=int(1e6))
    whole = 2 * (9 * h + f) + 2 * h
    assert e.frozen_persistent == whole * (4 + 2 + 4)  # fp32 main, bf16 copy, fp32 grad
    quantized = sum(-(-n // 2) for n in shape.unit_numels) + -(-(shape.persistent_numel - whole) // 2)
    assert abs(e.frozen_codes - quantized * 17 / 16) <= 64 * len(shape.unit_numels)  # + per-unit rounding


def test_cli_lora_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "162e6", "--device", "cpu", "--gpus", "4", "--sdp", "4",
                 "--lora-rank", "16", "--frozen-dtype", "int8"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "frozen base shard" in out and "int8 codes" in out and "no exact copy" in out and "(bf16" not in out
    assert "checkpoint, adapter-only" in out
    assert main(["estimate", "--params", "162e6", "--device", "cpu", "--gpus", "4", "--frozen-dtype", "nf4"]) == 2
    assert "give --lora-rank" in capsys.readouterr().err
