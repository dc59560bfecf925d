"""smp.set_activation_checkpointing at 2 ranks, sdp 2, every parameter sharded: training with checkpointed
GPT-NeoX layers equals training without, and each layer really ran again inside backward."""

from __future__ import annotations

from typing import Any

import pytest

from tests.multiproc import actckpt_cases

TOL = 1e-5


def _max_state_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert list(a) == list(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _compare(ranks, dropout: float, **checkpointing: Any) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    plain = ranks.run(2, actckpt_cases.train_case, None, dropout=dropout)
    ckpt = ranks.run(2, actckpt_cases.train_case, dropout=dropout, **checkpointing)
    return list(zip(ckpt, plain, strict=True))


CASES = [
    pytest.param({"strategy": "each"}, id="each-before-wrap"),
    pytest.param({"strategy": "group_2", "when": "after_wrap"}, id="group_2-after-wrap"),
    pytest.param({"strategy": "contiguous"}, id="contiguous"),
    pytest.param({"strategy": "each", "target": "layer0"}, id="one-layer"),
]


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("checkpointing", CASES)
def test_checkpointed_training_equals_plain_training(ranks, checkpointing: dict[str, Any], dropout: float) -> None:
    steps = actckpt_cases.STEPS
    checkpointed = range(1) if checkpointing.get("target") == "layer0" else range(2)
    for rank, (ckpt, plain) in enumerate(_compare(ranks, dropout, **checkpointing)):
        assert ckpt["units"] == plain["units"] == ["<root>", "gpt_neox.layers.0", "gpt_neox.layers.1"], ckpt["units"]
        assert ckpt["layer_class"] == "GPTNeoXLayer"
        assert ckpt["losses"] == pytest.approx(plain["losses"], abs=TOL), f"rank {rank}"
        assert _max_state_diff(ckpt["state"], plain["state"]) <= TOL, f"rank {rank}"
        assert ckpt["all_sharded"], "every unit sharded again after the steps"
        if dropout == 0.0:
            assert ckpt["ref_diff"] <= TOL and plain["ref_diff"] <= TOL, (ckpt["ref_diff"], plain["ref_diff"])
        for i, (c, p) in enumerate(zip(ckpt["counts"], plain["counts"], strict=True)):
            assert p == {"forward": steps, "backward": 0}, p
            recomputed = steps if i in checkpointed else 0  # the layer module called again in each backward
            assert c == {"forward": steps, "backward": recomputed}, f"rank {rank} layer {i}: {c}"


def test_dropout_without_preserved_rng_state_differs(ranks) -> None:
    """The control for the dropout cases: they draw masks at all, and the recomputation would draw
    others without preserve_rng_state."""
    pairs = _compare(ranks, 0.2, strategy="group_2", preserve_rng_state=False)
    assert max(_max_state_diff(c["state"], p["state"]) for c, p in pairs) > 1e-4
