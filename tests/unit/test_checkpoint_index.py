"""The partial checkpoint index's JSON value encoding (user_content, optimizer scalars)."""

from __future__ import annotations

import json

import pytest
import torch

from shardpar.checkpoint import index as ix


def _round_trip(value: object) -> object:
    return ix.decode(json.loads(json.dumps(ix.encode(value, where="user_content"))))


@pytest.mark.parametrize("shape", [(0, 4), (2, 0, 3), (3, 0), (0,), (), (2, 3)])
def test_a_tensor_round_trips_with_its_shape_also_when_a_dim_is_zero(shape: tuple[int, ...]) -> None:
    """tolist() of a (2, 0, 3) tensor is [[], []]: the dims after the empty one exist only in the shape."""
    value = torch.arange(torch.Size(shape).numel(), dtype=torch.int32).reshape(shape)
    back = _round_trip({"t": value})
    assert isinstance(back, dict)
    assert back["t"].shape == value.shape and back["t"].dtype == torch.int32
    assert torch.equal(back["t"], value)


def test_a_tensor_saved_without_its_shape_still_decodes() -> None:
    """Checkpoints written before the shape was stored have only the nested list."""
    old = {"__tensor__": [[1.0, 2.0], [3.0, 4.0]], "dtype": "F32", "on_device": False}
    assert torch.equal(ix.decode(old), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))


def test_a_dict_with_int_keys_is_refused_before_anything_is_written() -> None:
    """MultiStepLR's milestones (a Counter of ints): docs/checkpoints.md says to convert it first."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4])
    with pytest.raises(TypeError, match=r"user_content.scheduler.milestones: dict key 2 is not a string"):
        ix.encode({"scheduler": sched.state_dict()}, where="user_content")
