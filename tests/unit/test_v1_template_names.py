"""The names AWS's SMP v1 sharded-data-parallel templates use (issue 30 item 2), in a world of one:
each behaves as in v1, or is accepted with one rank-0 line on the "shardpar" logger saying what it does
here; and the errors of v1 idioms name the fix (item 6)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardpar as smp
from shardpar import v1_notes
from tests import models
from tests.conftest import init_world_of_one


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    v1_notes._said.clear()  # each test sees its own first note
    with init_world_of_one(monkeypatch, microbatches=2):
        yield


def _notes(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "shardpar"]


def test_model_creation_takes_the_templates_keywords_with_one_line_each(
    world: None, caplog: pytest.LogCaptureFixture
) -> None:
    v1 = {"zero_init": True, "distribute_embedding": True, "use_alibi": False, "fp32_residual_addition": True}
    with caplog.at_level(logging.WARNING, logger="shardpar"):
        for _ in range(2):  # a second model creation says nothing again
            with smp.model_creation(tensor_parallelism=False, dtype=torch.float32, flash_attention=True, **v1):
                module = models.tiny_neox()
    notes = _notes(caplog)
    assert len(notes) == 4, notes  # the True ones, once each
    assert any("zero_init=True" in n and "delayed_parameter_initialization" in n for n in notes)
    assert any("flash_attention=True" in n and "scaled_dot_product_attention" in n for n in notes)
    assert isinstance(module, nn.Module)
    with (
        pytest.raises(TypeError, match=r"model_creation\(use_alibi=1\): pass True or False"),
        smp.model_creation(use_alibi=1),
    ):
        pass


def test_model_and_optimizer_are_classes_and_the_deepspeed_views_match_the_shards(world: None) -> None:
    model = smp.DistributedModel(models.tiny_neox())
    # the template's get_param_groups_by_weight_decay: two groups, built from the wrapped module
    decay = [p for n, p in model.module.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in model.module.named_parameters() if n.endswith("bias")]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    # as the template does, before smp.DistributedOptimizer (which re-points the groups at the main pieces)
    params = [list(g["params"]) for g in groups]
    offsets = [{id(p): sum(q.ds_tensor.ds_numel for q in ps[:i]) for i, p in enumerate(ps)} for ps in params]
    opt = smp.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    assert isinstance(model, smp.DistributedModel) and isinstance(model, smp.model.DistributedModel)
    assert isinstance(opt, smp.DistributedOptimizer) and isinstance(opt, torch.optim.Optimizer)
    assert opt._global_grad_norm is None
    flat = opt.fp32_partitioned_groups_flat
    buffers = {id(p): flat[i].narrow(0, offsets[i][id(p)], p.ds_tensor.ds_numel)
               for i, ps in enumerate(params) for p in ps}  # fmt: skip
    full = {n: t.clone() for n, t in model.state_dict().items()}
    for name, p in model.named_parameters():
        assert torch.equal(buffers[id(p)], p.ds_tensor) and torch.equal(p.ds_tensor, full[name].reshape(-1)), name
    assert opt.ds_param_shard_group is next(iter(model.parameters())).ds_param_shard_group
    with pytest.raises(ValueError, match=r"spans more than one parameter's partition.*ds_numel"):
        flat[0].narrow(0, 0, flat[0].partitions[0].numel() + 1)

    loss = model(**models.lm_batch(0, 2)).loss
    model.backward(loss)
    opt.step()
    assert opt._global_grad_norm is opt.last_grad_norm and float(opt._global_grad_norm) > 0
    for name, p in model.named_parameters():  # the buffers are live: they see the step
        assert torch.equal(buffers[id(p)], model.state_dict()[name].reshape(-1)), name
    assert not all(torch.equal(model.state_dict()[n], full[n]) for n in full)


def test_grad_scaler_post_step_hooks_and_the_optimizer_local_state_dict(
    world: None, caplog: pytest.LogCaptureFixture
) -> None:
    model = smp.DistributedModel(models.tiny_neox())
    calls: list[Any] = []
    handle = model.register_post_step_hook(lambda m, o: calls.append(("early", m, o)))
    assert handle is not None  # no optimizer yet: after the next step
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert model.register_post_step_hook(lambda m, o: calls.append(("now", m, o))) is None  # v1: at once
    assert calls == [("now", model, opt)]
    with caplog.at_level(logging.WARNING, logger="shardpar"):
        scaler = smp.amp.GradScaler(init_scale=2.0**16)

    @smp.step
    def train_step(model: Any, batch: dict[str, torch.Tensor]) -> Any:
        out = model(**batch)
        model.backward(scaler.scale(out.loss))
        return out.loss, out.logits

    loss_mb, logits_mb = train_step(model, models.lm_batch(0, 4))
    scaler.step(opt)
    scaler.update()
    assert calls[1:] == [("early", model, opt)] and len(loss_mb) == 2 and logits_mb.concat().shape[0] == 4
    assert scaler.get_scale() == 1.0 and float(opt.last_grad_norm) > 0  # fp32: the optimizer's scale is 1
    assert any("smp.amp.GradScaler" in n and "DistributedOptimizer" in n for n in _notes(caplog))
    state = opt.local_state_dict(gather_if_shard=True, cast_to_cpu=True)
    assert state["_smp_is_partial"] and all(t.device.type == "cpu" for s in state["state"].values() for t in s.values())
    opt.load_state_dict(state, True)  # v1's second argument, gather_if_shard


def test_tp_register_and_v1_transformer_classes(world: None, caplog: pytest.LogCaptureFixture) -> None:
    class Block(nn.Linear):
        pass

    with caplog.at_level(logging.WARNING, logger="shardpar"):
        smp.tp_register_with_module(Block, smp.nn.DistributedTransformerLayer)
        assert smp.tp_register(smp.nn.DistributedLinear)(Block) is Block
    assert len(_notes(caplog)) == 2 and "keeps no registry" in _notes(caplog)[0]
    assert not isinstance(Block(2, 2), smp.nn.DistributedTransformerLayer)
    with pytest.raises(TypeError, match=r"smp.nn.DistributedTransformerLMHead is SMP v1's.*tensor_parallelism=True"):
        smp.nn.DistributedTransformerLMHead(num_layers=2)
    with pytest.raises(TypeError, match=r"takes nn.Module classes"):
        smp.tp_register_with_module("Block", smp.nn.DistributedLinear)
    with pytest.raises(AttributeError, match=r"'optimizers': .*element-wise torch optimizer"):
        smp.optimizers  # noqa: B018 - the attribute access is the test


def test_smp_save_v3_is_accepted_and_smp_load_reads_it(world: None, tmp_path: Path) -> None:
    smp.save({"x": torch.arange(3)}, tmp_path / "ckpt.pt", partial=True, v3=True)
    assert torch.equal(smp.load(tmp_path / "ckpt.pt", partial=True)["x"], torch.arange(3))


def test_resume_from_a_torch_save_file_loads_it_weights_only(world: None, tmp_path: Path) -> None:
    """The template's --fine_tune: torch.save(pretrained.state_dict(), dir/fullmodel.pt), then
    smp.resume_from_checkpoint(dir, tag="fullmodel.pt", partial=False)."""
    pretrained = models.tiny_neox(seed=7)
    torch.save(pretrained.state_dict(), tmp_path / "fullmodel.pt")
    model = smp.DistributedModel(models.tiny_neox(seed=0))
    smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"fullmodel.pt is a file.*pass partial=False"):
        smp.resume_from_checkpoint(tmp_path, tag="fullmodel.pt")
    assert smp.resume_from_checkpoint(tmp_path, tag="fullmodel.pt", partial=False) is None
    mine = model.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in pretrained.state_dict().items())

    torch.save({"model": pretrained.state_dict(), "args": _Args()}, tmp_path / "pickled.pt")
    with pytest.raises(ValueError, match=r"pickled.pt is a torch.save file that holds more than tensors.*weights-only"):
        smp.resume_from_checkpoint(tmp_path, tag="pickled.pt", partial=False)


class _Args:
    """Any class: unpickling it would run code, which weights-only loading refuses."""


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_casts_float_inputs_in_and_outputs_back(monkeypatch: pytest.MonkeyPatch, precision: str) -> None:
    """v1's fp16 wrapper: a float input meets half-precision weights (before: "mat1 and mat2 must have
    the same dtype"); integer inputs reach the module untouched; outputs come back fp32."""
    compute = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    with init_world_of_one(monkeypatch, **{precision: True}):
        torch.manual_seed(0)
        net = nn.ModuleDict({"emb": nn.Embedding(10, 13), "mlp": nn.Sequential(nn.Linear(13, 32), nn.Linear(32, 5))})
        seen: list[tuple[torch.dtype, torch.dtype]] = []

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.net = net

            def forward(self, ids: torch.Tensor, extra: torch.Tensor) -> dict[str, torch.Tensor]:
                seen.append((ids.dtype, extra.dtype))
                h = self.net["emb"](ids) + extra
                return {"out": self.net["mlp"](h), "ids": ids}

        model = smp.DistributedModel(Net())
        out = model(torch.tensor([1, 2, 3]), extra=torch.randn(3, 13))
        assert seen == [(torch.int64, compute)]
        assert out["out"].dtype == torch.float32 and out["ids"].dtype == torch.int64
        model.backward(out["out"].sum())
