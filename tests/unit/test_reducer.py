"""The gradient reducer's bucket plan ([Note: bucket plan] in shardpar/runtime/reducer.py), in one process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import shardpar as smp
from shardpar.runtime.reducer import plan_buckets
from tests import models
from tests.conftest import init_world_of_one


@pytest.fixture
def one_bucket_per_unit(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with init_world_of_one(monkeypatch, sdp_reduce_bucket_size=1, sdp_gradient_clipping=0.0):
        yield


def test_plan_is_reverse_unit_order_with_partly_frozen_units_last(one_bucket_per_unit: None) -> None:
    torch.manual_seed(0)
    module = models.UnevenMLP()
    module.blocks[0].up.weight.requires_grad_(False)
    model = smp.DistributedModel(module)
    order = [u.name for plan in model.reducer.plans for u in plan.units]
    assert order == ["blocks.2", "blocks.1", "<root>", "blocks.0"], order
    # a bucket as large as the two biggest units holds two of them; never more than the size
    sizes = {u.name: u.layout.padded_numel for u in model.units}
    pair = plan_buckets(model.units, sizes["blocks.2"] + sizes["blocks.1"])
    assert [u.name for u in pair[0].units] == ["blocks.2", "blocks.1"]
    for p in pair:
        assert p.width == sum(u.layout.shard_numel for u in p.units)
        assert list(p.columns) == [sum(u.layout.shard_numel for u in p.units[:i]) for i in range(len(p.units))]


def test_a_backward_that_raised_does_not_leak_into_the_next(one_bucket_per_unit: None) -> None:
    """blocks.2 and blocks.1 are reduced, then the backward raises before blocks.0: the next steps must
    train exactly as if the failed one never happened (plain SGD against a plain PyTorch copy)."""
    model, opt, ref, ref_opt = models.sgd_twins(models.UnevenMLP)

    def boom(grad: torch.Tensor) -> None:
        raise RuntimeError("injected failure in backward")

    def arm(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        out.register_hook(boom)

    hook = model.module.blocks[0].register_forward_hook(arm)
    with pytest.raises(RuntimeError, match="injected failure"):
        model.backward(model(**models.mlp_batch(99, 4)))
    hook.remove()
    assert any(u.reduced for u in model.units), "the failure came too early to test anything"
    opt.zero_grad()
    for step in range(2):
        batch = models.mlp_batch(step, 4)
        model.backward(model(**batch))
        opt.step()
        opt.zero_grad()
        ref(**batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    worst = models.max_param_diff(model, ref)
    assert worst <= 1e-6, f"parameters {worst:.2e} off the reference after a failed backward"
