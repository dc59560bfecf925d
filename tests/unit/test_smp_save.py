"""smp.save / smp.load (SageMaker v1's, issue 22 item 5): what torch.save would keep of tensors and
plain values, through safetensors and JSON -- no pickle."""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

import shardpar as smp


class Color(enum.IntEnum):
    RED = 3


def _obj() -> dict[str, object]:
    return {
        "model": OrderedDict(w=torch.randn(3, 4), b=torch.arange(5, dtype=torch.int64)),
        "step": 7,
        "lr": 1e-4,
        "nan": float("nan"),
        "milestones": {10: 0.1, 20: 0.01},  # int keys (MultiStepLR)
        "shape": torch.Size([2, 3]),
        "pair": (torch.ones(2, dtype=torch.bfloat16), "x"),
        "np": np.arange(6, dtype=np.float32).reshape(2, 3),
        "np_scalar": np.float64(2.5),
        "enum": Color.RED,
        "config": transformers.GPT2Config(n_layer=2, n_embd=32),
        "reserved": {"__tuple__": 1},
        "empty": torch.zeros(2, 0, 3),
        "none": None,
    }


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)  # type: ignore[index]
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    if isinstance(a, transformers.PretrainedConfig):
        return type(a) is type(b) and a.to_dict() == b.to_dict()
    return type(a) is type(b) and a == b


def test_round_trip_keeps_values_and_types(tmp_path: Path) -> None:
    obj = _obj()
    smp.save(obj, tmp_path / "ckpt.pt", partial=False)
    back = smp.load(tmp_path / "ckpt.pt", partial=False)
    assert back.pop("enum") == 3 and obj.pop("enum") is Color.RED  # an int enum comes back as its value
    assert _same(obj, back), back
    assert type(back["np_scalar"]) is np.float64
    # the tensors are plain safetensors entries: readable without shardpar, and no pickle anywhere
    assert len(safetensors.torch.load_file(tmp_path / "ckpt.pt")) == 5
    assert b"pickle" not in (tmp_path / "ckpt.pt").read_bytes()[:64]


def test_partial_files_are_per_rank_and_map_location_applies(world_of_one: None, tmp_path: Path) -> None:
    smp.save({"t": torch.ones(2)}, tmp_path / "p.pt")  # partial=True is v1's default
    assert (tmp_path / "p.pt_0").is_file() and not (tmp_path / "p.pt").exists()
    assert torch.equal(smp.load(tmp_path / "p.pt", map_location="cpu")["t"], torch.ones(2))
    assert smp.load(tmp_path / "p.pt", map_location=lambda t, _: t * 2)["t"].tolist() == [2.0, 2.0]


def test_refusals_name_the_value_and_the_rule(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"obj\['opt'\]\[1\]: a function cannot be stored .*no pickle"):
        smp.save({"opt": [1, lambda: 0]}, tmp_path / "x.pt", partial=False)
    assert not (tmp_path / "x.pt").exists()  # nothing half-written
    safetensors.torch.save_file({"a": torch.ones(1)}, tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match=r"was not written by smp\.save"):
        smp.load(tmp_path / "other.safetensors", partial=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        smp.load(tmp_path / "missing.pt", partial=False)
    with pytest.raises(RuntimeError, match=r"partial=True name the file by rank: call smp.init\(\) first"):
        smp.save({}, tmp_path / "y.pt")
