"""`shardpar estimate`: reference 003's configurations, the activation formula, the model-state
arithmetic and the command line. (Agreement with measured memory: tests/multiproc/test_recipe.py.)"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from shardpar import estimate as est
from shardpar.cli import main


@pytest.fixture(scope="module")
def neox20b() -> est.ModelShape:
    return est.reference_shape("gpt-neox-20b")


@pytest.fixture(scope="module")
def neox65b() -> est.ModelShape:
    return est.reference_shape("gpt-neox-65b")


def test_reference_models_have_their_sizes(neox20b: est.ModelShape, neox65b: est.ModelShape) -> None:
    assert neox20b.num_params == 20_554_567_680  # EleutherAI GPT-NeoX-20B
    assert neox20b.num_layers == 44 and len(neox20b.unit_numels) == 45  # root + one unit per layer
    assert 65.0e9 < neox65b.num_params < 65.5e9


def test_20b_on_two_p4d_fits_first_at_sdp_16(neox20b: est.ModelShape) -> None:
    row = est.REFERENCE_ROWS[0]
    assert (row.world, row.sdp, row.mini_batch) == (16, 16, 4)
    assert est.estimate(neox20b, row.setup()).fits
    assert not est.estimate(neox20b, row.setup(sdp=8)).fits
    best = est.smallest_fitting_sdp(neox20b, row.setup(), row.world)
    assert best is not None and best.setup.sdp == 16  # the reference's degree is the smallest that fits


def test_20b_on_eight_p4d_with_batch_12_fits_first_at_sdp_32(neox20b: est.ModelShape) -> None:
    row = est.REFERENCE_ROWS[1]
    assert est.tp_from_global_batch(row.world, row.global_batch, row.mini_batch) == 1
    best = est.smallest_fitting_sdp(neox20b, row.setup(), row.world)
    assert best is not None and best.setup.sdp == 32


def test_65b_rows_need_tensor_parallelism_and_fit_with_offloading(neox65b: est.ModelShape) -> None:
    for row in est.REFERENCE_ROWS[2:]:
        tp = est.tp_from_global_batch(row.world, row.global_batch, row.mini_batch)
        assert tp == row.tp  # 512 GPUs, global batch 512: mini-batch 8 -> tp 8, mini-batch 2 -> tp 2
        assert est.estimate(neox65b, row.setup()).fits
        assert not est.estimate(neox65b, row.setup(activation_checkpointing=False, activation_offloading=False)).fits
    row = est.REFERENCE_ROWS[2]
    # at the row's sdp 16 and mini-batch 8: no fit without tensor parallelism, with or without offloading;
    # tp 4 fits only with offloading
    for tp in (1, 2):
        for offload in (False, True):
            assert not est.estimate(neox65b, row.setup(tp=tp, activation_offloading=offload)).fits
    assert est.estimate(neox65b, row.setup(tp=4)).fits
    assert not est.estimate(neox65b, row.setup(tp=4, activation_offloading=False)).fits


def test_activations_follow_korthikanti_eq2() -> None:
    """No checkpointing, eager attention, tp 1, 2-byte activations: L * sbh(34 + 5as/h) + logits."""
    shape = est.shape_from_num_params(1e9, hidden=2048, num_layers=16, num_heads=16, vocab=1000)
    setup = est.Setup(batch=2, seq=512, precision="bf16", flash_attention=False, device="cpu")
    s, b, h, a = 512, 2, 2048, 16
    per_layer = s * b * h * (34 + 5 * a * s / h)
    logits = s * b * 1000 * (2 + 2 + 4)
    parts = est.estimate(shape, setup).parts
    assert parts["activations kept for backward"] == int(per_layer) * 16
    bucket = 4 * min(sum(shape.unit_numels), int(5e8) + max(shape.unit_numels))
    assert parts["working set: max(logits, layer + bucket)"] == max(logits, bucket)
    # tensor parallelism without sequence parallelism: sbh(10 + 24/t + 5as/(ht))
    tp2 = est.estimate(shape, replace(setup, tp=2)).parts["activations kept for backward"]
    assert tp2 == int(s * b * h * (10 + 12 + 5 * a * s / (h * 2))) * 16
    # checkpointing keeps each layer's input (2sbh bytes) and recomputes one layer at a time
    ckpt = est.estimate(shape, replace(setup, activation_checkpointing=True)).parts
    assert ckpt["activations kept for backward"] == 16 * s * b * h * 2
    assert ckpt["working set: max(logits, layer + bucket)"] == max(logits, int(per_layer) + bucket)
    offload = est.estimate(shape, replace(setup, activation_checkpointing=True, activation_offloading=True)).parts
    assert offload["activations kept for backward"] == 2 * s * b * h * 2  # two layer inputs in flight


def test_model_states_are_18_bytes_per_sharded_parameter_in_bf16() -> None:
    shape = est.ModelShape("toy", 8, 2, 2, 10, unit_numels=(100, 64, 64), persistent_numel=10)
    e = est.estimate(shape, est.Setup(sdp=4, precision="bf16", device="cpu"))
    sharded = 25 + 16 + 16
    assert e.model_states == (4 + 2 + 4 + 8) * (sharded + 10)
    e32 = est.estimate(shape, est.Setup(sdp=3, precision="fp32", device="cpu"))
    assert e32.model_states == (4 + 4 + 8) * (math.ceil(100 / 3) + 2 * math.ceil(64 / 3) + 10)


def test_bare_parameter_count_gives_a_gpt_like_shape() -> None:
    shape = est.shape_from_num_params(20e9)
    assert abs(shape.num_params - 20e9) / 20e9 < 0.05
    assert shape.hidden % 128 == 0 and shape.num_layers > 20


def test_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="must divide the world size 512"):
        est.tp_from_global_batch(512, 512 * 3, 1)
    with pytest.raises(ValueError, match="enable activation checkpointing"):
        est.Setup(activation_offloading=True)
    with pytest.raises(ValueError, match="device='tpu'"):
        est.Setup(device="tpu")


def test_cli_recommends_and_checks_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["estimate", "--model", "gpt-neox-20b", "--nodes", "2", "--batch", "4", "--activation-checkpointing"]) == 0
    )
    out = capsys.readouterr().out
    assert "smallest sharded_data_parallel_degree that fits: 16" in out
    assert main(["estimate", "--reference"]) == 0
    out = capsys.readouterr().out
    assert out.count("-> fits") == 4 and "tp 8 + offload" in out
    assert main(["estimate", "--params", "65e9", "--nodes", "1", "--batch", "8"]) == 1
    assert "nothing fits" in capsys.readouterr().out
