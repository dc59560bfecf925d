"""The non-finite guard in one process (issue 24 item 1): a NaN/inf loss or gradient skips the step with
weights and optimizer state bit-identical, training goes on, and sdp_max_nonfinite_steps consecutive
skips end in NonFiniteError; an empty batch is refused by @smp.step. Several ranks: tests/multiproc."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import shardpar as smp
from shardpar.config import Config
from shardpar.optim.nonfinite import NonFiniteError
from tests import models
from tests.conftest import init_world_of_one


def _twins() -> tuple[Any, Any, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = smp.DistributedModel(models.UnevenMLP())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    torch.manual_seed(0)
    ref = models.UnevenMLP()
    return model, opt, ref, torch.optim.AdamW(ref.parameters(), lr=1e-2)


BAD_LOSS = {
    "nan loss": lambda loss: loss + float("nan"),  # a detached NaN: the gradients alone would be finite
    "inf loss": lambda loss: loss * float("inf"),
}


@pytest.mark.parametrize("clip", [0.0, 1.0])
@pytest.mark.parametrize("bad", sorted(BAD_LOSS))
def test_a_non_finite_loss_skips_the_step_and_training_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, bad: str, clip: float
) -> None:
    with init_world_of_one(monkeypatch, sdp_gradient_clipping=clip):
        model, opt, ref, ref_opt = _twins()
        batches = [models.mlp_batch(s, 4) for s in range(4)]
        for step, batch in enumerate(batches):
            poisoned = step == 1
            loss = model(**batch)
            model.backward(BAD_LOSS[bad](loss) if poisoned else loss)
            before = models.shard_state(model, opt)
            with caplog.at_level(logging.WARNING, logger="shardpar"):
                opt.step()
            opt.zero_grad()
            if poisoned:  # the reference never saw this batch
                assert opt.skipped and models.same_tensors(before, models.shard_state(model, opt)), (
                    "a skipped step changed state"
                )
                assert "optimizer step 2 skipped on every rank" in caplog.text, caplog.text
                assert "non-finite loss in model.backward on ranks [0]" in caplog.text, caplog.text
                continue
            assert not opt.skipped
            ref(**batch).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            ref_opt.step()
            ref_opt.zero_grad()
        assert models.max_param_diff(model, ref) <= 1e-6


def test_consecutive_skips_raise_after_the_limit_and_a_clean_step_resets_the_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with init_world_of_one(monkeypatch, sdp_max_nonfinite_steps=2):
        model, opt, _, _ = _twins()

        def step(bad: bool) -> None:
            loss = model(**models.mlp_batch(0, 4))
            model.backward(loss * float("nan") if bad else loss)
            try:
                opt.step()
            finally:
                opt.zero_grad()

        for pattern in ([True, True, False], [True, True]):  # two skips, a clean step, two skips again
            for bad in pattern:
                step(bad)
        before = models.shard_state(model, opt)
        with pytest.raises(NonFiniteError) as err:
            step(True)
        message = str(err.value)
        assert "non-finite (nan) at 3 consecutive optimizer steps (steps 4-6)" in message, message
        assert "more than sdp_max_nonfinite_steps=2 allows" in message, message
        assert "those from before optimizer step 4" in message, message
        assert models.same_tensors(before, models.shard_state(model, opt))


def test_limit_zero_raises_at_the_first_non_finite_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    with init_world_of_one(monkeypatch, sdp_max_nonfinite_steps=0, bf16=True):
        model, opt, _, _ = _twins()

        def bf16_batch(seed: int) -> dict[str, torch.Tensor]:
            batch = models.mlp_batch(seed, 4)
            return {**batch, "x": batch["x"].to(torch.bfloat16)}

        model.backward(model(**bf16_batch(0)))
        opt.step()
        opt.zero_grad()
        batch = bf16_batch(1)
        batch["x"][2, 3] = float("inf")  # the data, not the loss: the gradients go non-finite in backward
        model.backward(model(**batch))
        before = models.shard_state(model, opt)
        with pytest.raises(NonFiniteError, match=r"at 1 consecutive optimizer steps \(step 2\), more than "):
            opt.step()
        assert models.same_tensors(before, models.shard_state(model, opt))


def test_the_knob_is_validated() -> None:
    assert Config().sdp_max_nonfinite_steps == 3
    with pytest.raises(ValueError, match=r"sdp_max_nonfinite_steps=-1 must be >= 0; the default is 3"):
        Config.from_dict({"sdp_max_nonfinite_steps": -1})
    with pytest.raises(ValueError, match=r"sdp_max_nonfinite_steps=1.5 must be a whole number"):
        Config.from_dict({"sdp_max_nonfinite_steps": 1.5})


@pytest.mark.parametrize("microbatches", [1, 2])
def test_an_empty_batch_is_refused_by_smp_step_naming_the_rank(
    monkeypatch: pytest.MonkeyPatch, microbatches: int
) -> None:
    with init_world_of_one(monkeypatch, microbatches=microbatches):
        model, opt, _, _ = _twins()

        @smp.step
        def train_step(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            loss = model(**batch)
            model.backward(loss)
            return loss

        batch = models.mlp_batch(0, 4)
        before = models.shard_state(model, opt)
        empty = {k: v[:0] for k, v in batch.items()}
        with pytest.raises(
            ValueError, match=r"rank 0: @smp.step got an empty batch: argument 1\['x'\] has shape \(0, 13\)"
        ):
            train_step(model, empty)
        assert models.same_tensors(before, models.shard_state(model, opt)) and model.window.num_backward == 0
        train_step(model, batch)  # a real batch still trains
        opt.step()
        assert not models.same_tensors(before, models.shard_state(model, opt))
