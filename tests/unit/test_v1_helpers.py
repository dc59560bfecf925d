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
    if family == "gptneo":
        cfg = transformers.GPTNeoConfig(
            hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]], **small
        )
        return transformers.GPTNeoForCausalLM(cfg)
    if family in ("bert", "roberta"):
        encoder = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
        if family == "bert":
            return transformers.BertForMaskedLM(transformers.BertConfig(**encoder, **small))
        return transformers.RobertaForMaskedLM(transformers.RobertaConfig(**encoder, pad_token_id=1, **small))
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, **small
    )
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("family", ["gpt2", "gptneox", "gptj", "llama", "gptneo", "bert", "roberta"])
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


def test_model_creation_delays_initialisation_and_sets_the_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `delayed_parameter_initialization` the model is built without parameter memory (meta), in
    the asked dtype, and wrapping gives exactly the values a normal build in that dtype gives."""
    from tests.conftest import init_world_of_one

    with init_world_of_one(monkeypatch, delayed_parameter_initialization=True):
        torch.manual_seed(0)
        with smp.model_creation(dtype=torch.bfloat16, attention_in_fp32=True, fused_softmax=True):
            model = models.tiny_neox()
        assert torch.get_default_dtype() == torch.float32
        assert {(p.dtype, p.is_meta) for p in model.parameters()} == {(torch.bfloat16, True)}
        wrapped = smp.DistributedModel(model)
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        try:
            ref = models.tiny_neox().state_dict()
        finally:
            torch.set_default_dtype(torch.float32)
        got = wrapped.state_dict()
        assert all(torch.equal(got[k], ref[k].float()) for k in ref)


def test_model_creation_marks_tensor_parallelism_and_checks_its_arguments(world_of_one: None) -> None:
    from shardpar.api.context import _TP_MARKS

    with smp.model_creation(tensor_parallelism=True, vocab_parallel_loss=True):
        model = models.tiny_neox()
    marks = _TP_MARKS.resolve(model, None)
    options = {o for o in marks.values() if o is not None}
    assert options and all(o.enabled and o.vocab_parallel_loss for o in options)
    with (
        pytest.raises(TypeError, match=r"unknown keyword\(s\) \['fused_everything'\]"),
        smp.model_creation(fused_everything=True),
    ):
        pass
    with pytest.raises(TypeError, match=r"dtype=torch.int8.*floating-point"), smp.model_creation(dtype=torch.int8):
        pass
    with pytest.raises(RuntimeError, match="boom"), smp.model_creation(dtype=torch.float16):
        raise RuntimeError("boom")
    assert torch.get_default_dtype() == torch.float32  # restored after an error inside


def _sgd_step_delta(monkeypatch: pytest.MonkeyPatch, average: bool) -> dict[str, torch.Tensor]:
    from tests.conftest import init_world_of_one

    with init_world_of_one(monkeypatch, microbatches=2, sdp_gradient_clipping=0.0):
        torch.manual_seed(0)
        model = smp.DistributedModel(
            models.tiny_neox(), average_grads_across_microbatches=average, trace_device="cpu", bucket_cap_mb=25
        )
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
        before = model.state_dict()

        @smp.step
        def train_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            loss = model(**batch).loss
            model.backward(loss)
            return loss

        train_step(model, models.lm_batch(0, 4))
        opt.step()
        after = model.state_dict()
        return {k: after[k] - before[k] for k in before}


def test_average_grads_across_microbatches_false_sums_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """v1: the gradients of the micro-batches are summed, not averaged: twice the step at 2 micro-batches."""
    averaged, summed = _sgd_step_delta(monkeypatch, True), _sgd_step_delta(monkeypatch, False)
    assert max(a.abs().max().item() for a in averaged.values()) > 0
    for k in averaged:
        torch.testing.assert_close(summed[k], 2 * averaged[k], rtol=1e-5, atol=1e-6)  # deltas of O(1) values


def test_v1_model_arguments_module_access_and_post_partition_hook(world_of_one: None) -> None:
    with pytest.raises(ValueError, match=r"trace_device='tpu'\): must be 'cpu' or 'gpu'"):
        smp.DistributedModel(models.tiny_neox(), trace_device="tpu")
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'trace_devices'"):
        smp.DistributedModel(models.tiny_neox(), trace_devices="cpu")
    model = smp.DistributedModel(models.tiny_neox(), overlapping_allreduce=False, broadcast_buffers=True)
    assert model.get_module() is model.module
    calls: list[tuple[object, object]] = []
    model.register_post_partition_hook(lambda m, o: calls.append((m, o)))
    removed = model.register_post_partition_hook(lambda m, o: calls.append(("removed", o)))
    removed.remove()
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert not calls  # not before the first forward
    batch = models.lm_batch(0, 2)
    model(**batch)
    model(**batch)
    assert calls == [(model, opt)]  # once, with the model and its optimizer
    with pytest.raises(TypeError, match="needs a callable"):
        model.register_post_partition_hook(3)  # type: ignore[arg-type]


def test_clip_master_grads_clips_once_like_clip_grad_norm(world_of_one: None) -> None:
    """SMP v1 fp16 scripts call optimizer.clip_master_grads(max_norm) before step(): the same as
    torch.nn.utils.clip_grad_norm_ on one process, and step() does not clip a second time."""
    torch.manual_seed(0)
    ref = models.tiny_neox()
    torch.manual_seed(0)
    model = smp.DistributedModel(models.tiny_neox())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    batch = models.lm_batch(0, 4)
    model.backward(model(**batch).loss)
    ref(**batch).loss.backward()
    norm = opt.clip_master_grads(0.05)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-5) and ref_norm > 0.05  # it did clip
    opt.step()
    ref_opt.step()
    got, want = model.state_dict(), ref.state_dict()
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6
    with pytest.raises(ValueError, match=r"max_norm=0\) must be a number > 0"):
        opt.clip_master_grads(0)


def test_fp16_groups_and_local_state_dict(world_of_one: None) -> None:
    model = smp.DistributedModel(models.tiny_neox())
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = smp.DistributedOptimizer(torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}]))
    names = {p: n for n, p in model.named_parameters()}
    groups = opt.fp16_groups
    assert [[names[p] for p in g] for g in groups] == [[names[p] for p in decay], [names[p] for p in rest]]
    model.backward(model(**models.lm_batch(0, 2)).loss)
    opt.step()
    local = opt.local_state_dict()
    assert local["_smp_is_partial"] is True and local["state"]
    opt.load_state_dict(local)  # the marker is accepted back


def test_manual_partitioning_accepts_the_one_partition_and_refuses_others() -> None:
    """pipeline_parallel_degree is 1: partition 0 is every module's; another index cannot be honoured."""
    with smp.partition(0):
        layer = nn.Linear(2, 2)
    smp.set_partition(layer, 0)
    with (
        pytest.raises(ValueError, match=r"partition 1 does not exist: pipeline_parallel_degree is 1"),
        smp.partition(1),
    ):
        pass
    with pytest.raises(ValueError, match=r"set_partition\(Linear, 2\): partition 2 does not exist"):
        smp.set_partition(layer, 2)
    with pytest.raises(TypeError, match="must be an int"):
        smp.set_partition(layer, "0")  # type: ignore[arg-type]


def test_smp_state_cfg_is_the_config(world_of_one: None) -> None:
    """transformers' SMP v1 integration and AWS's scripts read `smp.state.cfg.<key>`."""
    assert smp.state.cfg is smp.get_config()
    assert smp.state.cfg.sharded_data_parallel_degree == 1 and smp.state.cfg.fp16 is False


def test_set_tensor_parallelism_marks_a_built_model_like_the_context() -> None:
    from shardpar.api.context import _TP_MARKS

    model = models.tiny_neox()
    smp.set_tensor_parallelism(model, fused_softmax=True)  # v1's kernel switches are accepted
    smp.set_tensor_parallelism(model.gpt_neox.layers[1], False)
    marks = _TP_MARKS.resolve(model, None)
    enabled = {id(m): o is not None and o.enabled for m in model.modules() for o in [marks[id(m)]]}
    layer1 = {id(m) for m in model.gpt_neox.layers[1].modules()}
    assert all(not on for i, on in enabled.items() if i in layer1)  # the whole subtree off
    assert all(on for i, on in enabled.items() if i not in layer1)
    with smp.tensor_parallelism():  # a context mark inside a part switched off afterwards
        built = models.tiny_neox()
    smp.set_tensor_parallelism(built.gpt_neox, False)
    marks = _TP_MARKS.resolve(built, None)
    assert not any(marks[id(m)].enabled for m in built.gpt_neox.modules())  # type: ignore[union-attr]
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['fused_all'\]"):
        smp.set_tensor_parallelism(model, fused_all=True)
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['fused_all'\]"), smp.tensor_parallelism(fused_all=1):
        pass
    with smp.tensor_parallelism(fused_bias_gelu=True, fused_softmax=False):
        pass


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"load_sharded_optimizer_state": False}, "pass load_optimizer=False"),
        ({"translate_function": lambda sd: sd}, "nothing to translate"),
    ],
)
def test_resume_refuses_the_v1_arguments_it_cannot_honour(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        smp.resume_from_checkpoint("/nonexistent", **kwargs)
