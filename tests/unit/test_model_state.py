"""DistributedModel.load_state_dict against nn.Module.load_state_dict: tied names, missing and
unexpected keys (a world of one, in this process; tests/multiproc/test_checkpoint.py loads a tied
GPT-2 sharded over two ranks)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import shardpar as smp
from shardpar.runtime.model import DistributedModel


class _Tied(nn.Module):
    """A tied weight big enough to shard (24 elements, threshold 10), a tied one kept persistent (4),
    a persistent buffer and one that is not (torch leaves it out of state dicts)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(4)
        self.norm_out = nn.LayerNorm(4)
        self.norm_out.weight = self.norm.weight
        self.register_buffer("steps", torch.arange(2.0))
        self.register_buffer("cache", torch.zeros(3), persistent=False)


def _model() -> smp.DistributedModel:
    torch.manual_seed(0)
    model = smp.DistributedModel(_Tied())
    if not (model.units and model.persistent.named):
        raise AssertionError("the test needs a sharded and a persistent tied parameter")
    return model


def _state(model: smp.DistributedModel) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_tied_parameter_loads_from_whichever_of_its_names_the_dict_holds(world_of_one: None) -> None:
    model = _model()
    by_alias = {k: v + 1.0 for k, v in _state(model).items() if k not in ("embed.weight", "norm.weight")}
    model.load_state_dict(by_alias, strict=True)
    after = model.state_dict()
    for key, value in by_alias.items():
        assert torch.equal(after[key], value), key
    assert torch.equal(after["embed.weight"], by_alias["head.weight"])  # the sharded one
    assert torch.equal(after["norm.weight"], by_alias["norm_out.weight"])  # the persistent one


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ({"drop": ["embed.weight", "head.weight"]}, "missing keys ['embed.weight', 'head.weight']"),
        ({"drop": ["steps"]}, "missing keys ['steps']"),
        ({"add": "norm.weightt"}, "unexpected keys ['norm.weightt']"),
        ({"add": "cache"}, "unexpected keys ['cache']"),  # not persistent: torch calls it unexpected too
    ],
)
def test_strict_raises_like_torch_before_anything_is_written(
    world_of_one: None, edit: dict[str, object], words: str
) -> None:
    model = _model()
    before = _state(model)
    bad = {k: v + 1.0 for k, v in before.items() if k not in edit.get("drop", [])}
    if "add" in edit:
        bad[str(edit["add"])] = torch.zeros(3)
    with pytest.raises(RuntimeError, match=r"Missing key|Unexpected key"):
        _Tied().load_state_dict(bad, strict=True)
    with pytest.raises(ValueError, match=r"strict=True.*" + re.escape(words)):
        model.load_state_dict(bad, strict=True)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()), "a refused load changed the model"


def test_strict_false_reports_and_skips_what_torch_does(world_of_one: None) -> None:
    model = _model()
    before = _state(model)
    loose = {k: v + 1.0 for k, v in before.items() if k not in ("embed.weight", "head.weight", "steps")}
    # a non-persistent buffer of another size is unexpected, not a size mismatch (old GPT-2 attn.bias)
    loose.update({"typo.weight": torch.zeros(2), "cache": torch.ones(5)})
    ref = _Tied()
    expected = ref.load_state_dict(loose, strict=False)
    got = model.load_state_dict(loose, strict=False)
    assert (got.missing_keys, got.unexpected_keys) == (expected.missing_keys, expected.unexpected_keys)
    after = model.state_dict()
    assert torch.equal(after["norm.weight"], loose["norm.weight"])
    assert torch.equal(after["embed.weight"], before["embed.weight"]) and torch.equal(after["steps"], before["steps"])
    assert torch.equal(model.module.cache, torch.zeros(3)), "a non-persistent buffer is never loaded"


def test_tied_names_holding_different_values_are_refused(world_of_one: None) -> None:
    model = _model()
    state = _state(model)
    state["head.weight"] = state["head.weight"] + 1.0
    with pytest.raises(ValueError, match=r"'embed.weight' and 'head.weight' name one tied parameter"):
        model.load_state_dict(state, strict=False)


def test_assign_true_is_refused_before_anything_is_written(world_of_one: None) -> None:
    model = _model()
    before = _state(model)
    with pytest.raises(ValueError, match=r"load_state_dict\(assign=True\) is not supported.*pass assign=False"):
        model.load_state_dict({k: v + 1.0 for k, v in before.items()}, assign=True)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()), "a refused load changed the model"


def test_a_missing_attribute_is_an_attribute_error_naming_it(world_of_one: None) -> None:
    model = _model()
    assert hasattr(model, "embed") and not hasattr(model, "nope")  # the inner module's, then neither's
    with pytest.raises(AttributeError, match="'nope'"):
        _ = model.nope
    del model.module
    assert not hasattr(model, "nope") and not hasattr(model, "embed")
    with pytest.raises(AttributeError, match="'embed'"):
        _ = model.embed
    unbuilt = DistributedModel.__new__(DistributedModel)  # as seen before __init__ sets anything
    assert not hasattr(unbuilt, "nope")


def test_a_parent_loads_and_saves_the_wrapped_model_through_its_own_state_dict(world_of_one: None) -> None:
    """nn.Module's recursion reaches the wrapper: keys under its prefix (the unwrapped model's names) load
    into the shards; missing, unexpected and mis-shaped keys are reported as torch reports them."""
    parent = nn.Module()
    parent.head = nn.Linear(3, 3)
    parent.wrapped = _model()
    state = parent.state_dict()
    assert "wrapped.embed.weight" in state and "head.weight" in state
    changed = {k: v + 1.0 for k, v in state.items()}
    result = parent.load_state_dict(changed)
    assert not result.missing_keys and not result.unexpected_keys
    after = parent.state_dict()
    assert all(torch.equal(after[k], changed[k]) for k in state), "a key did not load"
    tied = ("wrapped.embed.weight", "wrapped.head.weight")  # one parameter under two names: missing when both go
    partial = {k: v for k, v in state.items() if k not in tied}
    partial["wrapped.nope"] = torch.zeros(1)
    with pytest.raises(
        RuntimeError, match=r"(?s)Missing key\(s\).*wrapped\.embed\.weight.*Unexpected key\(s\).*wrapped\.nope"
    ):
        parent.load_state_dict(partial)
    result = parent.load_state_dict(partial, strict=False)
    assert result.missing_keys == list(tied) and result.unexpected_keys == ["wrapped.nope"]
    bad = dict(state)
    bad["wrapped.embed.weight"] = torch.zeros(2, 2)
    with pytest.raises(RuntimeError, match=r"size mismatch for embed\.weight"):
        parent.load_state_dict(bad)
