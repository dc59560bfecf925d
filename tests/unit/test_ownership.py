"""The owner plan (shardpar/optim/ownership.py, issue 31 item 2): every parameter stepped whole by one
rank, balanced by the optimizer's work and bytes, the same on every rank; and `shardpar estimate
--optimizer muon|adafactor` printing it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from shardpar.cli import estimate as est
from shardpar.cli.owner_estimate import a2a_bytes_per_rank, block_matrices, format_owner_plan, plan_for
from shardpar.optim.ownership import plan_owners, state_bytes, work


def _gpt(hidden: int, layers: int) -> SimpleNamespace:
    return SimpleNamespace(hidden=hidden, num_layers=layers, vocab=50304)


def test_muon_work_is_newton_schulz_and_state_is_a_momentum_buffer() -> None:
    assert work((1024, 256), "muon") == 1024 * 256 * 256
    assert work((1024, 256), "adafactor") == 1024 * 256
    assert state_bytes((1024, 256), "muon") == 4 * 1024 * 256
    assert state_bytes((1024, 256), "adafactor") == 4 * (1024 + 256)  # factored row and column statistics


@pytest.mark.parametrize("kind", ["muon", "adafactor"])
@pytest.mark.parametrize("members", [2, 4, 8])
def test_every_parameter_has_one_owner_and_bytes_stay_within_a_quarter_of_the_even_share(
    kind: str, members: int
) -> None:
    params = block_matrices(_gpt(768, 12))  # GPT-2 small's blocks: 48 matrices of 4 shapes
    plan = plan_owners(params, kind, members)
    assert [o.fqn for o in plan.owned] == [f for f, _ in params], "the plan keeps the parameters' order"
    assert all(0 <= o.owner < members for o in plan.owned)
    assert sum(len(plan.of(m)) for m in range(members)) == len(params)
    assert plan.imbalance("bytes") <= 1.25, plan.load("bytes")
    assert plan.imbalance("work") <= 1.25, plan.load("work")
    assert plan_owners(params, kind, members) == plan, "every rank computes the same plan"


def test_one_member_owns_everything_and_sends_nothing() -> None:
    plan = plan_owners([("a", (4, 4)), ("b", (8, 2))], "muon", 1)
    assert {o.owner for o in plan.owned} == {0}
    assert a2a_bytes_per_rank(plan, tp=1) == 0


def test_estimate_prints_the_owner_plan() -> None:
    shape = est.ModelShape(
        name="gpt", hidden=768, num_layers=12, num_heads=12, vocab=50304, unit_numels=(85_000_000,), persistent_numel=0
    )
    setup = est.Setup(sdp=8, world=8, optimizer="muon")
    text = format_owner_plan(shape, setup)
    assert "owner compute (muon): 48 matrices stepped whole over 8 ranks" in text, text
    plan = plan_for(shape, setup)
    owned = max(sum(math.prod(o.shape) for o in plan.of(m)) for m in range(8))
    assert a2a_bytes_per_rank(plan, tp=1) == 2 * 8 * (owned / 8) * 4
    with pytest.raises(ValueError, match="optimizer='lion'"):
        est.Setup(sdp=8, world=8, optimizer="lion")
