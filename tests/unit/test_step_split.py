"""smp.step's batch splitting: every container kind a data loader yields comes back as its own kind."""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import pytest
import torch

from shardpar.api.step import make_step, split_batch


class Batch(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor
    tag: str


class ScopedBatch(Mapping[str, Any]):
    """A read-only mapping whose constructor wants more than the items: cannot be rebuilt."""

    def __init__(self, scope: str, items: dict[str, Any]) -> None:
        self.scope, self.items_ = scope, items

    def __getitem__(self, key: str) -> Any:
        return self.items_[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.items_)

    def __len__(self) -> int:
        return len(self.items_)


def test_a_namedtuple_batch_splits_into_namedtuples() -> None:
    batch = Batch(torch.arange(6).view(6, 1), torch.arange(6), "train")
    parts = split_batch(batch, 3)
    assert [type(p) for p in parts] == [Batch] * 3
    assert [p.y.tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert [p.x.shape for p in parts] == [(2, 1)] * 3 and {p.tag for p in parts} == {"train"}


def test_a_defaultdict_batch_keeps_its_type_and_default_factory() -> None:
    batch: defaultdict[str, Any] = defaultdict(list, {"x": torch.arange(4)})
    parts = split_batch(batch, 2)
    assert [type(p) for p in parts] == [defaultdict] * 2
    assert [p["x"].tolist() for p in parts] == [[0, 1], [2, 3]]
    assert parts[0]["missing"] == []  # the factory still answers a missing key


def test_mappings_keep_their_type_or_fall_back_to_a_plain_dict() -> None:
    ordered = split_batch(OrderedDict(b=torch.arange(4), a=torch.arange(4, 8)), 2)
    assert [type(p) for p in ordered] == [OrderedDict] * 2 and list(ordered[1]) == ["b", "a"]
    scoped = split_batch(ScopedBatch("eval", {"x": torch.arange(4)}), 2)
    assert [type(p) for p in scoped] == [dict] * 2
    assert [p["x"].tolist() for p in scoped] == [[0, 1], [2, 3]]


def test_smp_step_hands_each_micro_batch_of_a_nested_namedtuple_to_the_step_function() -> None:
    seen: list[Any] = []

    def train_step(batch: Mapping[str, Batch]) -> torch.Tensor:
        seen.append(batch)
        return batch["pair"].y.sum()

    step = make_step(train_step, find_model=lambda: None, microbatches=lambda: 2)
    out = step(defaultdict(int, pair=Batch(torch.zeros(4, 1), torch.arange(4), "t")))
    assert [o.item() for o in out.outputs] == [1, 5]  # y = 0+1, then 2+3
    assert [(type(b), type(b["pair"])) for b in seen] == [(defaultdict, Batch)] * 2


def test_v1_step_arguments_dict_outputs_and_detach(monkeypatch: pytest.MonkeyPatch) -> None:
    """SMP v1: `@smp.step(...)` with non_split_inputs / input_split_axes, dict outputs as a dict of
    StepOutputs, StepOutput.detach(), and detached outputs by default."""
    import shardpar as smp
    from tests.conftest import init_world_of_one

    with init_world_of_one(monkeypatch, microbatches=2):
        _check_v1_step(smp)


def _check_v1_step(smp: Any) -> None:
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    @smp.step(non_split_inputs=["table"], input_split_axes={"seq_major": 1})
    def train_step(x: torch.Tensor, seq_major: torch.Tensor, table: torch.Tensor) -> dict[str, torch.Tensor]:
        seen.append((tuple(seq_major.shape), tuple(table.shape)))
        y = (x * 2).requires_grad_()
        return {"loss": y.sum(), "y": y}

    out = train_step(torch.ones(4, 3), torch.zeros(5, 4), table=torch.zeros(7))
    assert seen == [((5, 2), (7,)), ((5, 2), (7,))]  # axis 1 split, the table passed whole
    assert out["loss"].reduce_mean().item() == 12.0 and len(out["y"]) == 2
    assert not out["y"][0].requires_grad  # detach_outputs=True (v1's default)
    # v1's structure: a dict return comes back a dict with a StepOutput per key (issue 30), no longer one
    # StepOutput of dicts, so detach() is asked of the entry
    assert type(out) is dict and out["loss"].detach().stack().tolist() == [12.0, 12.0]

    @smp.step()
    def plain(x: torch.Tensor) -> torch.Tensor:
        return x.sum()

    assert plain(torch.ones(4, 2)).reduce_sum().item() == 8.0
    with pytest.raises(ValueError, match=r"'nope' \(in non_split_inputs / input_split_axes\) is not an argument"):
        smp.step(non_split_inputs=["nope"])(plain.__wrapped__)
    with pytest.raises(TypeError, match=r"StepOutput\['loss'\]: the step returned \['Tensor'\], not dicts"):
        plain(torch.ones(4, 2))["loss"]


class _Sliceable:
    """SMP v1's protocol for a type the library cannot split itself."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def smp_slice(self, num_mb: int, mb: int, axis: int) -> _Sliceable:
        size = self.data.shape[axis] // num_mb
        return _Sliceable(self.data.narrow(axis, mb * size, size))


def test_an_object_with_smp_slice_is_split_by_it() -> None:
    parts = split_batch({"x": _Sliceable(torch.arange(12).view(2, 6))}, 3, axis=1)
    assert [p["x"].data.tolist() for p in parts] == [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]
