"""sharding/plan.py's choice of units (`wrap=`) and parameter owners, and the persistence threshold's boundary."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import shardpar as smp
from shardpar.sharding.plan import choose_unit_modules, plan_units
from tests.models import Block, UnevenMLP

# Random module trees: Linear leaves, Sequential inner nodes.
trees = st.recursive(
    st.builds(lambda: nn.Linear(2, 2)),
    lambda kids: st.lists(kids, min_size=1, max_size=3).map(lambda ms: nn.Sequential(*ms)),
    max_leaves=10,
)


def _ancestors(name: str) -> list[str]:
    """Proper, non-root ancestors of a module FQN: "a.b.c" -> ["a", "a.b"]."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))] if name else []


@given(trees, st.data())
def test_wrap_predicate_picks_the_outermost_matching_modules(root: nn.Module, data: st.DataObject) -> None:
    names = [n for n, _ in root.named_modules()]
    picked = data.draw(st.sets(st.sampled_from(names)))  # may include the root, which is never a unit
    modules = dict(root.named_modules())
    ids = {id(modules[n]) for n in picked}

    def predicate(m: nn.Module) -> bool:
        return id(m) in ids

    expected = [n for n in names if n and n in picked and not any(a in picked for a in _ancestors(n))]
    chosen = choose_unit_modules(root, predicate)
    assert [n for n, _ in chosen] == expected
    assert all(m is modules[n] for n, m in chosen)
    # every parameter is owned by exactly one unit: the innermost chosen module around it, else the root
    units = plan_units(root, predicate)
    assert [u.name for u in units] == ["", *expected]
    owners = {fqn: u.name for u in units for fqn, _ in u.params}
    assert sorted(owners) == sorted(n for n, _ in root.named_parameters())
    for fqn, owner in owners.items():
        around = [a for a in _ancestors(fqn) if a in expected]
        assert owner == (around[-1] if around else ""), fqn
    assert not any(u.borrowed for u in units)


def test_wrap_classes_equal_the_isinstance_predicate_and_reject_non_modules() -> None:
    model = UnevenMLP()
    by_class = choose_unit_modules(model, [nn.Linear])
    by_predicate = choose_unit_modules(model, lambda m: isinstance(m, nn.Linear))
    assert [n for n, _ in by_class] == [n for n, _ in by_predicate]
    assert [n for n, _ in by_class][:3] == ["inp", "blocks.0.up", "blocks.0.down"]
    # default: the children of the outermost repeated ModuleList
    assert [n for n, _ in choose_unit_modules(model, None)] == ["blocks.0", "blocks.1", "blocks.2"]
    with pytest.raises(TypeError, match="wrap must be module classes or a predicate"):
        choose_unit_modules(model, [nn.Linear, "Block"])  # type: ignore[list-item]


def test_a_single_wrap_class_means_a_list_of_that_class() -> None:
    # A class is callable, but wrap=Block must not be called as a predicate: Block(module) would fail
    # in its constructor, and nn.Sequential(module) would build a (truthy) module and match everything.
    model = UnevenMLP()
    assert [n for n, _ in choose_unit_modules(model, Block)] == ["blocks.0", "blocks.1", "blocks.2"]
    assert choose_unit_modules(model, Block) == choose_unit_modules(model, [Block])
    assert choose_unit_modules(model, {Block}) == choose_unit_modules(model, (Block,))  # any iterable of classes
    assert [u.name for u in plan_units(model, nn.Linear)] == [u.name for u in plan_units(model, [nn.Linear])]


@pytest.mark.parametrize("wrap", [[nn.Conv2d], nn.Conv2d, [], [UnevenMLP]], ids=["list", "class", "empty", "root"])
def test_wrap_classes_that_match_no_module_below_the_root_are_an_error(wrap: object) -> None:
    # Matching nothing would leave only the root unit: the whole model gathered at once, silently.
    model = UnevenMLP()
    with pytest.raises(ValueError, match=r"matches no module below the root UnevenMLP \(its modules: Linear x") as e:
        choose_unit_modules(model, wrap)  # type: ignore[arg-type]
    assert "Block x3" in str(e.value) and "wrap=None" in str(e.value)
    # a predicate may legitimately match nothing (one root unit, on purpose)
    assert choose_unit_modules(model, lambda m: False) == []


def test_a_tied_parameter_is_owned_once_and_borrowed_by_the_other_unit() -> None:
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    units = plan_units(model, [nn.Embedding, nn.Linear])
    assert [(u.name, [n for n, _ in u.params], len(u.borrowed)) for u in units] == [
        ("", [], 0),
        ("0", ["0.weight"], 0),
        ("1", [], 1),
    ]
    assert units[2].borrowed[0] is model[0].weight


def _shape(numel: int) -> tuple[int, ...]:
    """2-D where numel allows, so that the rule is seen to compare element counts, not a dim."""
    return (2, numel // 2) if numel > 2 and numel % 2 == 0 else (numel,)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 40))
def test_a_parameter_with_exactly_threshold_elements_is_sharded(threshold: int) -> None:
    """numel >= sdp_param_persistence_threshold: sharded (in a unit); numel < threshold: persistent
    (docs/design.md, glossary). Through smp.DistributedModel in a world of one, in this process."""
    smp.init({"sdp_param_persistence_threshold": threshold, "ddp_dist_backend": "nccl"})
    try:
        module = nn.Module()
        for name, numel in {"below": threshold - 1, "at": threshold, "above": threshold + 1}.items():
            module.register_parameter(name, nn.Parameter(torch.ones(_shape(numel))))
        model = smp.DistributedModel(module)
        assert [n for n, _ in model.persistent.named] == ["below"]
        assert [s.fqn for u in model.units for s in u.layout.specs] == ["at", "above"]
    finally:
        smp.shutdown()


def test_large_modules_outside_the_blocks_become_units_of_their_own() -> None:
    """[Note: large modules outside the blocks] (sharding/plan.py): untied embeddings and LM head of at
    least OWN_UNIT_NUMEL elements are units, in forward order around the blocks; smaller ones, tied
    ones and models without repeated blocks keep them in the root."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM

    from shardpar.sharding.plan import OWN_UNIT_NUMEL
    from tests.models import tiny_neox

    def neox(vocab: int, layers: int = 2) -> nn.Module:
        cfg = GPTNeoXConfig(
            vocab_size=vocab, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=256,
            tie_word_embeddings=False,
        )  # fmt: skip
        with torch.device("meta"):
            return GPTNeoXForCausalLM(cfg)

    big = OWN_UNIT_NUMEL // 64  # vocab x hidden 64 = exactly OWN_UNIT_NUMEL
    units = plan_units(neox(big), None)
    assert [u.name for u in units] == ["", "gpt_neox.embed_in", "gpt_neox.layers.0", "gpt_neox.layers.1", "lm_head"]
    assert [fqn for fqn, _ in units[1].params] == ["gpt_neox.embed_in.weight"]
    assert [fqn for fqn, _ in units[-1].params] == ["lm_head.weight"]
    assert [fqn for fqn, _ in units[0].params] == ["gpt_neox.final_layer_norm.weight", "gpt_neox.final_layer_norm.bias"]
    # one element short: they stay in the root
    assert [u.name for u in plan_units(neox(big - 1), None)] == ["", "gpt_neox.layers.0", "gpt_neox.layers.1"]
    # no repeated blocks (a list of one layer): only the root, as before
    assert [u.name for u in plan_units(neox(big, layers=1), None)] == [""]
    # tied input and output embeddings (GPT-2): both users stay in the root
    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=big, n_embd=64, n_layer=2, n_head=4, n_positions=32))
    assert [u.name for u in plan_units(gpt2, None)] == ["", "transformer.h.0", "transformer.h.1"]
    # the test models keep their units (embeddings far below the threshold)
    assert [u.name for u in plan_units(tiny_neox(), None)] == ["", "gpt_neox.layers.0", "gpt_neox.layers.1"]
    # an explicit wrap= is the user's choice: nothing is added to it
    assert [u.name for u in plan_units(neox(big), lambda m: type(m).__name__ == "GPTNeoXLayer")] == [
        "", "gpt_neox.layers.0", "gpt_neox.layers.1",
    ]  # fmt: skip
