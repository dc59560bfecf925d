"""The helper modules recipes/smp_v1 ships with its v1-style script: the learning-rate schedule, the
JSON-lines data pipeline and the shapes it records in checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardpar as smp
from recipes.smp_v1.data_pipeline import create_pretraining_dataloader
from recipes.smp_v1.learning_rates import AnnealingLR
from recipes.smp_v1.sharded_data_parallel_checkpoint import get_buffer_names, get_param_shapes
from tests import models


def test_the_schedule_warms_up_decays_and_resumes_from_its_state() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    sched = AnnealingLR(opt, start_lr=1.0, warmup_iter=2, plateau_iter=4, total_iters=8, decay_style="linear")
    lrs = []
    for _ in range(9):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [0.5, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    again = AnnealingLR(opt, start_lr=1.0, warmup_iter=2, plateau_iter=4, total_iters=8, decay_style="linear")
    again.load_state_dict(sched.state_dict())
    assert again.get_lr() == sched.get_lr() == opt.param_groups[0]["lr"]
    with pytest.raises(ValueError, match="decay_style='step'"):
        AnnealingLR(opt, 1.0, 0, 0, 8, "step")


def test_the_data_pipeline_splits_samples_over_data_parallel_ranks(world_of_one: None, tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text("".join(json.dumps({"input_ids": [i] * 6}) + "\n" for i in range(10)))
    seen = []
    for rank in range(2):
        loader = create_pretraining_dataloader([str(path)], 2, 4, seed=0, dp_rank=rank, dp_size=2, zipped=False)
        batches = list(loader)
        assert len(batches) == 2 and all(ids.shape == (2, 4) and mask.shape == (2, 4) for ids, mask in batches)
        seen += [int(ids[0]) for ids, _ in batches for ids in ids]
    assert sorted(seen) == [0, 1, 2, 3, 4, 5, 6, 7]  # each sample once; the last 2 do not fill a batch


def test_buffer_names_are_the_persistent_ones(world_of_one: None) -> None:
    module = models.tiny_neox()
    module.gpt_neox.layers[1].register_buffer("step", torch.zeros(()))  # persistent
    module.gpt_neox.layers[1].register_buffer("scratch", torch.zeros(3), persistent=False)
    model = smp.DistributedModel(module)
    assert get_buffer_names(model) == ["gpt_neox.layers.1.step"]


def test_param_shapes_are_the_global_shapes(world_of_one: None) -> None:
    ref = models.tiny_neox()
    expected = {n: p.shape for n, p in ref.named_parameters()}
    model = smp.DistributedModel(models.tiny_neox())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    (shapes,) = get_param_shapes(model, opt)
    assert dict(shapes) == expected
