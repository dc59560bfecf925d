"""`shardpar estimate`: reference 003's configurations, the activation formula and its agreement with
the tensors a tiny GPT-NeoX saves for backward, the model-state arithmetic and the command line.
(Model states against live tensors of a run: tests/multiproc/test_recipe.py.)"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardpar.cli import estimate as est
from shardpar.cli import main
from shardpar.cli import memory_model as mm
from shardpar.cli import recommend as rec


@pytest.fixture(scope="module")
def neox20b() -> est.ModelShape:
    return est.reference_shape("gpt-neox-20b")


@pytest.fixture(scope="module")
def neox65b() -> est.ModelShape:
    return est.reference_shape("gpt-neox-65b")


def test_reference_models_have_their_sizes(neox20b: est.ModelShape, neox65b: est.ModelShape) -> None:
    assert neox20b.num_params == 20_554_567_680  # EleutherAI GPT-NeoX-20B
    # root (final layer norm), input embeddings, one unit per layer, LM head (sharding/plan.py)
    assert neox20b.num_layers == 44 and len(neox20b.unit_numels) == 47
    assert neox20b.kinds == ("root", "embedding", *["block"] * 44, "head")
    assert 65.0e9 < neox65b.num_params < 65.5e9


def test_20b_on_two_p4d_fits_first_at_sdp_16(neox20b: est.ModelShape) -> None:
    row = est.REFERENCE_ROWS[0]
    assert (row.world, row.sdp, row.mini_batch) == (16, 16, 4)
    assert est.estimate(neox20b, row.setup()).fits
    assert not est.estimate(neox20b, row.setup(sdp=8)).fits
    best = rec.smallest_fitting_sdp(neox20b, row.setup(), row.world)
    assert best is not None and best.setup.sdp == 16  # the reference's degree is the smallest that fits


def test_20b_on_eight_p4d_with_batch_12_fits_first_at_sdp_32(neox20b: est.ModelShape) -> None:
    row = est.REFERENCE_ROWS[1]
    assert rec.tp_from_global_batch(row.world, row.global_batch, row.mini_batch) == 1
    best = rec.smallest_fitting_sdp(neox20b, row.setup(), row.world)
    assert best is not None and best.setup.sdp == 32


def test_65b_rows_need_tensor_parallelism_and_fit_with_offloading(neox65b: est.ModelShape) -> None:
    for row in est.REFERENCE_ROWS[2:]:
        tp = rec.tp_from_global_batch(row.world, row.global_batch, row.mini_batch)
        assert tp == row.tp  # 512 GPUs, global batch 512: mini-batch 8 -> tp 8, mini-batch 2 -> tp 2
        assert est.estimate(neox65b, row.setup()).fits
        assert not est.estimate(neox65b, row.setup(activation_checkpointing=False, activation_offloading=False)).fits
    row = est.REFERENCE_ROWS[2]
    # at the row's sdp 16 and mini-batch 8: no fit without tensor parallelism, with or without offloading;
    # at tp 4 offloading the checkpointed inputs saves most of the activations (the rest is model state)
    for offload in (False, True):
        assert not est.estimate(neox65b, row.setup(tp=1, activation_offloading=offload)).fits
    kept = est.estimate(neox65b, row.setup(tp=4, activation_offloading=False))
    offloaded = est.estimate(neox65b, row.setup(tp=4))
    assert offloaded.fits and offloaded.total < 0.7 * kept.total


def test_activation_formula_counts_each_saved_tensor() -> None:
    """No checkpointing, eager attention, tp 1, bf16: per layer 16 c sbh + (4 + c) a s s b; logits."""
    shape = est.shape_from_num_params(8.1e8, hidden=2048, num_layers=16, num_heads=16, vocab=1000)
    setup = est.Setup(batch=2, seq=512, precision="bf16", flash_attention=False, device="cpu")
    s, b, h, a, c = 512, 2, 2048, 16, 2
    per_layer = s * b * h * c * 16 + a * s * s * b * (4 + c)
    logits = s * b * 1000 * (2 + 2 + 4)
    assert est.activation_bytes(shape, setup) == (per_layer, 0, logits)
    # fp32: the softmax is kept once (no compute-dtype copy)
    fp32 = est.activation_bytes(shape, replace(setup, precision="fp32"))[0]
    assert fp32 == s * b * h * 4 * 16 + a * s * s * b * 4
    # tensor parallelism without sequence parallelism: c sbh (4 + 12/t) + scores / t
    tp2 = est.activation_bytes(shape, replace(setup, tp=2))[0]
    assert tp2 == s * b * h * c * (4 + 6) + a * s * s * b * (4 + c) // 2
    # checkpointing keeps each layer's input (c sbh bytes) and recomputes one layer at a time
    ckpt = replace(setup, activation_checkpointing=True)
    assert est.activation_bytes(shape, ckpt) == (s * b * h * c, per_layer, logits)
    # offloading keeps nothing on the device but the inputs backward has reloaded: the one it recomputes
    # and activation_loading_horizon (default 4) more
    offload = replace(ckpt, activation_offloading=True)
    assert est.activation_bytes(shape, offload) == (0, per_layer + 5 * s * b * h * c, logits)
    one = replace(offload, activation_loading_horizon=1)
    assert est.activation_bytes(shape, one) == (0, per_layer + 2 * s * b * h * c, logits)
    with pytest.raises(ValueError, match="activation_loading_horizon=0 must be >= 1"):
        replace(offload, activation_loading_horizon=0)
    # the walk holds every layer's activations and the logits at the end of forward
    x = est.step_inputs(shape, setup)
    end_of_forward = [m for m in est.mm.walk(x) if m.where.startswith("forward")][-1]
    assert end_of_forward.parts["activations"] == 16 * per_layer + logits


# ---- activations measured: what autograd really saves in one forward of the tiny GPT-NeoX --------


class _Marked(nn.Module):
    """Wraps one transformer layer; `inside[0]` is True while it (or its checkpoint wrapper) runs."""

    def __init__(self, layer: nn.Module, inside: list[bool]) -> None:
        super().__init__()
        self.layer, self.inside = layer, inside

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.inside[0] = True
        try:
            return self.layer(*args, **kwargs)
        finally:
            self.inside[0] = False


def _saved_by_layers(config: Any, *, batch: int, seq: int, dtype: torch.dtype, checkpointing: bool) -> int:
    """Bytes of the distinct storages autograd saves for backward inside the transformer layers
    during one training forward (parameters excluded: they are model state, not activations)."""
    from recipes.causal_lm import models as recipe_models

    torch.manual_seed(0)
    module = recipe_models.build(config).to(dtype).train()
    if checkpointing:  # as recipes/causal_lm/train.py enables it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    inside = [False]
    layers = module.gpt_neox.layers
    for i, layer in enumerate(layers):
        layers[i] = _Marked(layer, inside)
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()  # views of one storage (q, k, v of one projection) count once
        if inside[0] and storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    ids = torch.randint(0, config.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(input_ids=ids, labels=ids)
    return sum(saved.values())


@pytest.mark.parametrize("checkpointing", [False, True], ids=["full", "checkpointed"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_estimate_matches_saved_tensors_of_tiny_neox(
    precision: str, attention: str, checkpointing: bool
) -> None:
    """The recipe's tiny GPT-NeoX (configs/tiny_neox.toml: batch 4, seq 128) in one process."""
    from recipes.causal_lm import models as recipe_models

    batch, seq = 4, 128
    config = recipe_models.hf_config("gpt_neox", "tiny", vocab_size=256, seq=seq)
    config._attn_implementation = attention
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    measured = _saved_by_layers(config, batch=batch, seq=seq, dtype=dtype, checkpointing=checkpointing)
    setup = est.Setup(
        batch=batch, seq=seq, precision=precision, activation_checkpointing=checkpointing,
        flash_attention=attention == "sdpa", device="cpu",
    )  # fmt: skip
    shape = est.shape_from_hf_config(config)
    estimated = shape.num_layers * est.activation_bytes(shape, setup)[0]
    assert abs(estimated - measured) <= 0.10 * measured, (
        f"estimate {estimated:,} B vs {measured:,} B saved ({estimated / measured - 1:+.1%})"
    )


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
        rec.tp_from_global_batch(512, 512 * 3, 1)
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
    rows = [line for line in out.splitlines() if line.startswith("  gpt-neox")]
    assert sum("-> fits" in line for line in rows) == 4 and "tp 8 + offload" in out
    assert main(["estimate", "--params", "65e9", "--nodes", "1", "--batch", "8"]) == 1
    assert "nothing fits" in capsys.readouterr().out


def test_cli_reads_a_hugging_face_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    config = GPTNeoXConfig(
        hidden_size=1024, num_hidden_layers=6, num_attention_heads=8, intermediate_size=4096, vocab_size=32000,
        max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        num_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    argv = ["estimate", "--hf-config", str(tmp_path / "config.json"), "--device", "cpu", "--sdp", "1"]
    assert main([*argv, "--batch", "4", "--seq", "2048", "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    assert f"config: {num_params:,} parameters, 6 layers, hidden 1024" in out, out
    # model states: 16 bytes per parameter (fp32 AdamW), every one whole at sdp 1
    lines = out.splitlines()
    assert f"  {'model states: fp32 main parameters':42s} {4 * num_params / est.GiB:9.2f} GiB" in lines, out
    assert f"  {'model states: optimizer state':42s} {8 * num_params / est.GiB:9.2f} GiB" in lines, out
    # the peak is the LM head's backward: 6 layers x 16 x 4 bytes x s b h of activations
    # kept, and the logits (12 bytes per element in fp32)
    assert "  peak: backward of unit 8 (head)" in lines, out
    activations = 6 * 16 * 4 * 2048 * 4 * 1024 + 2048 * 4 * 32000 * 12
    assert f"  {'activations and logits':42s} {activations / est.GiB:9.2f} GiB" in lines, out
    # a directory holding config.json works too, and recommends a degree on a device with a capacity
    assert main(["estimate", "--hf-config", str(tmp_path), "--device", "a100-40gb", "--gpus", "8"]) == 0
    assert "smallest sharded_data_parallel_degree that fits: 1" in capsys.readouterr().out


@pytest.mark.parametrize("threshold", [0, 200, 5000, 10**12])
def test_bare_parameter_count_splits_persistent_tensors_as_gpt_neox_does(threshold: int) -> None:
    """The --params shape is GPT-NeoX's layout (12h^2 + 13h per layer, untied embeddings), so at any
    persistence threshold it must keep the same tensors whole as the real model's units."""
    from transformers import GPTNeoXConfig

    config = GPTNeoXConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    real = est.shape_from_hf_config(config, persistence_threshold=threshold)
    bare = est.shape_from_num_params(
        real.num_params, hidden=64, num_layers=2, vocab=256, persistence_threshold=threshold
    )
    assert (bare.unit_numels, bare.persistent_numel) == (real.unit_numels, real.persistent_numel)


@pytest.mark.parametrize("model", [["--model", "gpt-neox-20b"], ["--params", "20e9"]], ids=["reference", "params"])
def test_cli_persistence_threshold_reaches_every_model_source(
    model: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Above every tensor's size, the threshold keeps the whole model on each rank: 4 bytes of fp32 main
    parameters per parameter instead of a 1/16 shard."""
    argv = ["estimate", *model, "--nodes", "2", "--sdp", "16", "--persistence-threshold", "1e12"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    num_params = int(out.split(" parameters,")[0].split(": ")[-1].replace(",", ""))
    main_line = f"  {'model states: fp32 main parameters':42s} {4 * num_params / est.GiB:9.2f} GiB"
    assert main_line in out.splitlines(), out


def test_cli_without_a_capacity_lists_sizes_without_a_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--device", "cpu", "--gpus", "4", "--model", "gpt_neox:tiny", "--seq", "128"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("  ") and ln.strip().endswith("GiB")]
    assert [r[0] for r in rows] == ["1", "2", "4"], out
    assert "nothing fits" not in out and "no known capacity" in out


def test_cli_says_plainly_when_no_alternative_fits(capsys: pytest.CaptureFixture[str]) -> None:
    """20B on one p4d (8 x 40 GB) fits in no variant: no header announcing an empty list."""
    assert main(["estimate", "--params", "20e9", "--nodes", "1"]) == 1
    out = capsys.readouterr().out
    assert "other choices" not in out and "nothing fits on 8 x a100-40gb" in out, out


SHAPES = [(512, 8, 1024), (768, 12, 50304), (1024, 36, 50304), (2048, 3, 50304), (256, 1, 8192)]


@pytest.mark.parametrize(("hidden", "layers", "vocab"), SHAPES)
def test_gpt_neox_shape_from_dims_is_the_models_own(hidden: int, layers: int, vocab: int) -> None:
    """The arithmetic shape (bench_memory.py's sizes, the capacity family, one layer) equals the units
    DistributedModel would build from the real model on the meta device (sharding/plan.py)."""
    from transformers import GPTNeoXConfig

    config = GPTNeoXConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64, intermediate_size=4 * hidden,
        vocab_size=vocab, tie_word_embeddings=False,
    )  # fmt: skip
    real = est.shape_from_hf_config(config)
    dims = est.shape_from_dims(hidden, layers, vocab=vocab, num_heads=hidden // 64)
    fields = ("unit_numels", "persistent_numel", "kinds", "max_tensor_numel", "persistent_per_unit")
    assert {f: getattr(dims, f) for f in fields} == {f: getattr(real, f) for f in fields}


def test_shard_optimizer_state_splits_the_fp32_state_over_the_replicas(neox20b: est.ModelShape) -> None:
    """Issue 23: with R replicas the fp32 master (mixed precision only: in fp32 the shard is the master),
    main grads and Adam state are 1/R of the shard, each unit padded to a multiple of sdp x R; the compute
    shard stays; a shard-sized main grad lives until the boundary ReduceScatter."""
    shape = est.shape_from_num_params(4.07e8, hidden=2048, num_layers=8, num_heads=16, vocab=1000)
    units, p = shape.unit_numels, shape.persistent_numel
    for precision, c in (("bf16", 2), ("fp32", 4)):
        setup = est.Setup(sdp=4, precision=precision, world=32, device="cpu")
        off, on = est.estimate(shape, setup), est.estimate(shape, replace(setup, shard_optimizer_state=True))
        owned = sum(math.ceil(n / 32) for n in units)  # sdp 4 x 8 replicas
        master = 4 * owned if c == 2 else 4 * owned * 8
        assert on.setup.replicas == 8 and off.setup.replicas == 8
        assert on.parts["model states: fp32 main parameters"] == master + 4 * p
        assert on.parts["model states: optimizer state"] == 8 * (owned + p)
        assert on.parts["model states: compute-dtype copies"] == (c * (owned * 8 + p) if c == 2 else 0)
        # the walk: the boundary backward builds shard-sized main grads; at its end the replication
        # ReduceScatter's output (this rank's piece) exists beside them; the optimizer sees the piece
        walked = replace(on.setup, reduce_bucket_size=int(5e7))  # several buckets: some issued in backward
        moments = {m.where: m.parts for m in mm.walk(est.step_inputs(shape, walked))}
        end, step = moments["end of backward"], moments["optimizer step"]
        assert end["shard gradients"] == 4 * owned * 8 and end["main gradients"] == 4 * (owned + p)
        assert step["main gradients"] == 4 * (owned + p) and "shard gradients" not in step
        last = moments[next(w for w in moments if w.startswith("backward of unit 1 "))]
        assert last["shard gradients"] > 0 and "main gradients" not in last
        plain = [m.parts for m in mm.walk(est.step_inputs(shape, off.setup))]
        assert all(not m.get("shard gradients") for m in plain)
        states = sum(v for k, v in on.parts.items() if k.startswith("model states:") and "gradients" not in k)
        assert on.model_states == states + 4 * (owned + p)  # the piece's main grads live across steps
        assert on.model_states < off.model_states / 2.5 and on.total < off.total
    # one replica: nothing to split
    one = est.Setup(sdp=32, precision="bf16", world=32, device="cpu")
    assert est.estimate(shape, replace(one, shard_optimizer_state=True)).parts == est.estimate(shape, one).parts
    # reference 003, 20B on 64 GPUs: sdp 32 (2 replicas) is the smallest that fits; with the knob sdp 8
    # (8 replicas) fits already
    row = est.REFERENCE_ROWS[1]
    plain = rec.smallest_fitting_sdp(neox20b, row.setup(), row.world)
    assert plain is not None and plain.setup.sdp == 32
    best = rec.smallest_fitting_sdp(neox20b, row.setup(shard_optimizer_state=True), row.world)
    assert best is not None and best.setup.sdp == 8 and best.setup.replicas == 8


def test_cli_shows_the_shard_optimizer_state_saving(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--model", "gpt-neox-20b", "--nodes", "8", "--sdp", "32", "--activation-checkpointing"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main([*argv, "--shard-optimizer-state"]) == 0
    knob = capsys.readouterr().out
    assert "shard_optimizer_state" in knob and "shard gradients before their ReduceScatter" in knob
    assert "shard gradients" not in plain
    assert main(["estimate", "--reference"]) == 0
    lines = capsys.readouterr().out.splitlines()
    knob_lines = [line for line in lines if "with shard_optimizer_state" in line]
    assert len(knob_lines) == len(est.REFERENCE_ROWS)
    assert "(2 replicas): model states 10.8 -> 6.0 GiB" in knob_lines[1], knob_lines[1]
