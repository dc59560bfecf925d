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


def _expected_offload_events(frames: list[int], horizon: int) -> list[tuple[str, int]]:
    """One step's offloader events ([Note: activation offloading]): each checkpoint (named by its first
    layer) offloaded in forward; in backward the last one's recomputation reloads it and the `horizon`
    before it, and each later recomputation reloads the one `horizon` checkpoints further back."""
    events = [("offload", f) for f in frames]
    last = len(frames) - 1
    events += [("reload", frames[j]) for j in range(last, max(-1, last - horizon - 1), -1)]
    events.append(("recompute", frames[last]))
    for i in range(last - 1, -1, -1):
        if i - horizon >= 0:
            events.append(("reload", frames[i - horizon]))
        events.append(("recompute", frames[i]))
    return events


def test_expected_offload_events_read_as_the_note_says() -> None:
    assert _expected_offload_events([0, 1, 2, 3], 1) == [
        *[("offload", i) for i in range(4)],
        ("reload", 3),
        ("reload", 2),
        ("recompute", 3),
        ("reload", 1),
        ("recompute", 2),
        ("reload", 0),
        ("recompute", 1),
        ("recompute", 0),
    ]


OFFLOAD_CASES = [
    pytest.param("each", 1, 0.0, id="each-horizon-1"),
    pytest.param("each", 2, 0.2, id="each-horizon-2-dropout"),
    pytest.param("group_2", 1, 0.0, id="group_2-horizon-1"),
]


@pytest.mark.parametrize(("strategy", "horizon", "dropout"), OFFLOAD_CASES)
def test_offloaded_checkpoints_train_as_plain_training(ranks, strategy: str, horizon: int, dropout: float) -> None:
    """offload_activations at 2 ranks, sdp 2, 4 sharded layers: the same losses and parameters as no
    checkpointing, bit for bit, every checkpoint offloaded in forward and reloaded `horizon` checkpoints ahead of its
    recomputation, in exactly that order, each step."""
    layers, steps = 4, actckpt_cases.STEPS
    plain = ranks.run(2, actckpt_cases.train_case, None, dropout=dropout, layers=layers)
    offloaded = ranks.run(
        2, actckpt_cases.train_case, strategy=strategy, dropout=dropout, layers=layers, offload_horizon=horizon
    )
    frames = list(range(0, layers, 2 if strategy == "group_2" else 1))
    for rank, (off, p) in enumerate(zip(offloaded, plain, strict=True)):
        # Bit-identical: the recomputation reads back exactly the bytes that left the device.
        assert off["losses"] == p["losses"], f"rank {rank}"
        assert _max_state_diff(off["state"], p["state"]) == 0, f"rank {rank}"
        if dropout == 0.0:
            assert off["ref_diff"] <= TOL, off["ref_diff"]
        assert off["offload_events"] == _expected_offload_events(frames, horizon) * steps, f"rank {rank}"
        assert off["offload_counts"] == (len(frames) * steps, len(frames) * steps)  # one hidden state each
        assert off["offload_bytes"] == len(frames) * steps * 2 * 16 * 32 * 4  # 2 sequences x 16 tokens x 32 fp32
        assert [c["backward"] for c in off["counts"]] == [steps] * layers, off["counts"]  # every layer recomputed
