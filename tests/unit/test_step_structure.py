"""`@smp.step` returns the step function's own structure with a StepOutput in each place (SMP v1;
issue 30 item 1), with v1's reductions."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch

from shardpar.api.step import StepOutput, make_step

Pair = namedtuple("Pair", "loss tag")


def _step(fn: Any, microbatches: int = 2) -> Any:
    return make_step(fn, find_model=lambda: None, microbatches=lambda: microbatches)


def test_a_tuple_return_unpacks_into_one_step_output_per_place() -> None:
    """The tutorial's `return loss, correct`: each name holds its own value per micro-batch, never the
    other name's (before, the two micro-batches' losses were unpacked into `loss_mb, correct_mb`)."""

    def train_step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x - y).pow(2).mean(), (x.round() == y).sum()

    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    y = torch.tensor([1.0, 0.0, 3.0, 0.0, 0.0, 6.0])
    loss_mb, correct_mb = _step(train_step)(x, y)
    assert isinstance(loss_mb, StepOutput) and isinstance(correct_mb, StepOutput)
    assert loss_mb.stack().tolist() == pytest.approx([4 / 3, 41 / 3])  # mb 0: [1,2,3]; mb 1: [4,5,6]
    assert loss_mb.reduce_mean().item() == pytest.approx((4 / 3 + 41 / 3) / 2)
    assert correct_mb.reduce_sum().item() == 3 and correct_mb.outputs[0].item() == 2
    mean_correct = correct_mb.reduce_mean()  # v1: sum / count, so an integer count gives a float mean
    assert mean_correct.dtype.is_floating_point and mean_correct.item() == 1.5


def test_dict_list_namedtuple_and_nested_returns_keep_their_structure() -> None:
    def train_step(x: torch.Tensor) -> Any:
        return {"loss": x.sum(), "parts": [x, x.max()], "pair": Pair(x.mean(), "train")}

    out = _step(train_step, 3)(torch.arange(6.0))
    assert type(out) is dict and list(out) == ["loss", "parts", "pair"]
    assert out["loss"].outputs == [torch.tensor(1.0), torch.tensor(5.0), torch.tensor(9.0)]
    assert type(out["parts"]) is list and out["parts"][0].concat().tolist() == [0, 1, 2, 3, 4, 5]
    assert out["parts"][1].reduce_sum().item() == 1 + 3 + 5
    assert type(out["pair"]) is Pair and out["pair"].tag.outputs == ["train"] * 3
    assert out["pair"].loss.reduce_mean().item() == pytest.approx(2.5)


def test_non_tensor_values_are_places_too() -> None:
    def train_step(x: torch.Tensor) -> Any:
        return x.sum(), int(x.numel()), None, float(x[0])

    _, count, nothing, first = _step(train_step)(torch.arange(4.0))
    assert count.outputs == [2, 2] and count.reduce_sum() == 4 and count.reduce_mean() == 2.0
    assert list(nothing) == [None, None] and first.reduce_mean() == 1.0  # (0.0 + 2.0) / 2
    with pytest.raises(TypeError, match=r"StepOutput.reduce_mean\(\) sums tensors or numbers.*NoneType.*\.outputs"):
        nothing.reduce_mean()
    with pytest.raises(TypeError, match=r"StepOutput.concat\(\) joins tensors.*\['int'\].*\.outputs"):
        count.concat()


def test_a_single_returned_value_is_one_step_output_as_before() -> None:
    out = _step(lambda x: x.sum(), 2)(torch.ones(4, 3))
    assert isinstance(out, StepOutput) and len(out) == 2 and out.reduce_sum().item() == 12.0
    assert [o.item() for o in out] == [6.0, 6.0] and out[1].item() == 6.0
    assert out.map(lambda t: t * 2) is out and out.outputs == [torch.tensor(12.0)] * 2  # v1's map: in place


def test_micro_batches_returning_different_structures_are_an_error_naming_the_place() -> None:
    def ragged(x: torch.Tensor) -> Any:
        return {"loss": x.sum()} if x[0] == 0 else {"loss": x.sum(), "extra": x}

    with pytest.raises(
        ValueError, match=r"micro-batch 0 returned a dict \(keys \['loss'\]\).*micro-batch 1 a dict of 2"
    ):
        _step(ragged)(torch.arange(4.0))

    def reordered(x: torch.Tensor) -> Any:  # the same keys in another order are the same structure
        return {"a": x[0], "b": x[1]} if x[0] == 0 else {"b": x[1], "a": x[0]}

    assert _step(reordered)(torch.arange(4.0))["b"].outputs == [torch.tensor(1.0), torch.tensor(3.0)]

    def nested(x: torch.Tensor) -> Any:
        return x.sum(), [x] * int(x[0] + 1)

    with pytest.raises(ValueError, match=r"as the step function's return value\[1\].*same structure"):
        _step(nested)(torch.arange(4.0))


def test_a_step_output_argument_hands_each_micro_batch_its_own_value() -> None:
    """SMP v1: an earlier step's StepOutput passed to a step is unpacked per micro-batch, not split."""
    first = _step(lambda x: x * 10)(torch.arange(4.0))
    seen = []
    _step(lambda prev: seen.append(prev.tolist()))(first)
    assert seen == [[0.0, 10.0], [20.0, 30.0]]
    with pytest.raises(ValueError, match=r"StepOutput of 2 micro-batches .* runs 4 micro-batches"):
        _step(lambda prev: None, 4)(first)
