"""The partial checkpoint index's JSON value encoding (user_content, optimizer scalars)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardpar.checkpoint import index as ix
from shardpar.checkpoint.safetensors_io import CheckpointError


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


def test_user_content_keeps_int_keys_counters_numpy_and_hf_configs() -> None:
    """issue 22: MultiStepLR's state (a Counter of int milestones) and v1 scripts' user_content (numpy
    values, torch.Size, OrderedDicts, int-keyed dicts, HF configs) round-trip as they were, through JSON.
    (This replaces a test that the int-keyed milestones were refused: the issue asks for them.)"""
    import collections

    import numpy as np
    import transformers

    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4, 4])
    content = {
        "scheduler": sched.state_dict(),
        "shape": torch.Size([3, 4]),
        "order": collections.OrderedDict(b=1, a=(2, 3)),
        "ids": {3: "x", 1: "y"},
        "np": (np.int64(5), np.ones((2, 2), dtype=np.float16)),
        "config": transformers.GPT2Config(n_layer=1),
    }
    back = ix.decode(json.loads(json.dumps(ix.encode(content, where="user_content"))))
    assert back["scheduler"]["milestones"] == collections.Counter({2: 1, 4: 2})
    assert type(back["scheduler"]["milestones"]) is collections.Counter
    new_sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[1])
    new_sched.load_state_dict(back["scheduler"])
    assert new_sched.milestones == sched.milestones
    assert back["shape"] == torch.Size([3, 4]) and type(back["shape"]) is torch.Size
    assert back["order"] == content["order"] and type(back["order"]) is collections.OrderedDict
    assert back["ids"] == {3: "x", 1: "y"} and list(back["ids"]) == [3, 1]
    assert type(back["np"][0]) is np.int64 and back["np"][1].dtype == np.float16
    assert back["config"].to_dict() == content["config"].to_dict()


def test_other_objects_are_refused_naming_their_path() -> None:
    with pytest.raises(TypeError, match=r"user_content\['opt'\]\[1\]: a object cannot be stored .*no pickle"):
        ix.encode({"opt": [1, object()]}, where="user_content")


def test_a_file_where_a_checkpoint_directory_belongs_is_named_a_file_with_where_it_loads(tmp_path: Path) -> None:
    """Issue 30 item 6: SMP v1's fullmodel.pt handed to a loader of checkpoint directories said
    "checkpoint directory is missing" of a file that exists."""
    file = tmp_path / "fullmodel.pt"
    file.write_bytes(b"not a directory")
    with pytest.raises(CheckpointError, match=r"fullmodel\.pt is a file, not a checkpoint directory .* partial=False"):
        ix.read_index(file)
    with pytest.raises(CheckpointError, match="checkpoint directory is missing"):
        ix.read_index(tmp_path / "nothing")
