"""smp.save_checkpoint / smp.resume_from_checkpoint argument rules, on a world of one (this process):
which optimizer the facade picks when none is passed, and export-only arguments with partial=True."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardpar as smp
from shardpar.optim.optimizer import DistributedOptimizer
from shardpar.runtime.model import DistributedModel
from tests import models


def _model(seed: int, **mlp: int) -> DistributedModel:
    torch.manual_seed(seed)
    return smp.DistributedModel(models.UnevenMLP(**mlp))


def _step(model: DistributedModel, opt: DistributedOptimizer) -> None:
    model.backward(model(**models.mlp_batch(0, 4)))
    opt.step()
    opt.zero_grad()


def _saved_optimizer(root: Path, tag: str) -> object:
    return json.loads((root / f"{tag}_partial" / "index.json").read_text())["optimizer"]


@pytest.mark.parametrize(("name", "value"), [("max_shard_size", 10_000), ("full_dtype", torch.bfloat16)])
def test_export_only_arguments_with_partial_are_an_error(
    world_of_one: None, tmp_path: Path, name: str, value: object
) -> None:
    model = _model(0)
    with pytest.raises(ValueError, match=rf"{name}=.*Hugging Face export only: pass partial=False"):
        smp.save_checkpoint(tmp_path, "t", model=model, **{name: value})  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == [], "nothing may be written before the error"
    smp.save_checkpoint(tmp_path, "full", partial=False, model=model, **{name: value})  # type: ignore[arg-type]
    assert (tmp_path / "full").is_dir()


def test_the_last_optimizer_is_saved_only_with_its_own_model(world_of_one: None, tmp_path: Path) -> None:
    model_a = _model(0)
    opt_a = smp.DistributedOptimizer(torch.optim.AdamW(model_a.parameters(), lr=1e-2))
    _step(model_a, opt_a)
    model_b = _model(1, hidden=5)  # built after opt_a: the facade's last optimizer is still opt_a
    smp.save_checkpoint(tmp_path, "b", model=model_b, user_content="b")
    assert _saved_optimizer(tmp_path, "b") is None, "model_b was saved with another model's optimizer"
    smp.save_checkpoint(tmp_path, "a", model=model_a)  # opt_a steps model_a: the fallback applies
    saved = _saved_optimizer(tmp_path, "a")
    assert isinstance(saved, dict) and saved["class"] == "AdamW" and saved["state"], saved
    with pytest.raises(ValueError, match="optimizer was built over another DistributedModel"):
        smp.save_checkpoint(tmp_path, "mixed", model=model_b, optimizer=opt_a)
    # resume goes into the last model (model_b) and, by the same rule, not into opt_a
    before = {id(p): v.clone() for p, s in opt_a.optimizer.state.items() for v in [s["exp_avg"]]}
    assert smp.resume_from_checkpoint(tmp_path, "b") == "b"
    after = {id(p): s["exp_avg"] for p, s in opt_a.optimizer.state.items()}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
