"""Tensor parallelism x sharded data parallelism on Hugging Face models (reference 003, "Sharded data
parallelism with tensor parallelism"): gradients and training match a single process within 1e-5."""

from __future__ import annotations

from typing import Any

import pytest

from tests.multiproc.tp_cases import facade_errors, run_many

pytest.importorskip("transformers")

TOL = 1e-5
SDP2 = {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 10}
# threshold 40: column-parallel biases (22-24 local elements) become persistent AND TP-split
SDP2_PERSISTENT = {**SDP2, "sdp_param_persistence_threshold": 40}
NUM_LAYERS = 2

GRAD_CASES: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    ("grad", "neox", {}, {}),
    ("grad", "llama", {}, {}),
    ("grad", "gpt2_tied", {}, {}),
    ("grad", "llama", {}, {"vocab_parallel_loss": True}),
    ("grad", "gpt2_tied", {}, {"vocab_parallel_loss": True}),
]

PARITY_CASES: dict[int, list[tuple[str, str, dict[str, Any], dict[str, Any]]]] = {
    4: [  # tp 2 x sdp 2
        ("parity", "neox", SDP2, {}),
        ("parity", "llama", SDP2_PERSISTENT, {"how": "context", "vocab_parallel_loss": True, "accum": 2}),
        ("parity", "gpt2_tied", SDP2, {"how": "context"}),
        ("parity", "neox", SDP2, {"delayed": True, "steps": 2}),
    ],
    8: [  # tp 2 x sdp 2 x 2 replicas
        ("parity", "neox", SDP2, {}),
        ("parity", "llama", SDP2_PERSISTENT, {"how": "context", "vocab_parallel_loss": True, "accum": 2}),
    ],
}


def test_converted_gradients_match_hf(ranks) -> None:
    """tp 2: loss, logits and EVERY gradient (gathered to the HF layout) equal the unconverted model's;
    TP-replicated gradients (norms, row-parallel biases, position embeddings) are bitwise equal on
    both TP ranks; each rank holds about half the parameters."""
    per_rank = ranks.run(2, run_many, GRAD_CASES, timeout=300)
    for (_, name, _, kw), result in zip(GRAD_CASES, per_rank[0], strict=True):
        label = f"{name} {kw}"
        for key in ("loss", "logits", "grad"):
            assert result[key] <= TOL, f"{label}: {key} diff {result[key]:.2e}"
        assert result["replicated_spread"] == 0.0, f"{label}: TP-replicated grads differ across TP ranks"
        assert result["num_split"] > 0 and result["num_replicated"] > 0
        assert result["local_numel"] < 0.6 * result["full_numel"], f"{label}: parameters were not split"


def _expected_tp_all_reduces(kw: dict[str, Any]) -> int:
    # per micro-batch: forward = embedding + 2 row-parallel per layer (+1 vocab-parallel loss);
    # backward = 2 copy regions per layer + the LM head's; per step: +1 for the TP-aware grad norm
    per_micro = (1 + 2 * NUM_LAYERS) + (2 * NUM_LAYERS + 1) + (1 if kw.get("vocab_parallel_loss") else 0)
    return kw.get("accum", 1) * per_micro + 1


@pytest.mark.parametrize("world", sorted(PARITY_CASES))
def test_tp_with_sharding_matches_single_process(ranks, world: int) -> None:
    cases = PARITY_CASES[world]
    per_rank = ranks.run(world, run_many, cases, timeout=600)
    for (_, name, knobs, kw), result in zip(cases, per_rank[0], strict=True):
        label = f"world {world} {name} {knobs} {kw}"
        for key in ("loss", "norm", "param"):
            assert result[key] <= TOL, f"{label}: {key} diff {result[key]:.2e}"
        assert result["tp_loss_spread"] == 0.0, f"{label}: TP ranks computed different losses"
        assert result["clipped"] == 1.0, f"{label}: clipping never engaged; lower the clip"
        assert result["all_sharded"] == 1.0, f"{label}: units left gathered after the step"
        assert result["tp_all_reduces"] == _expected_tp_all_reduces(kw), f"{label}: {result['tp_all_reduces']}"
        assert result["sharding_gathers"] > 0, f"{label}: nothing was sharded"
    for other in per_rank[1:]:  # the consolidated model is the same on every rank
        assert [r["param"] for r in other] == pytest.approx([r["param"] for r in per_rank[0]], abs=1e-7)


def test_invalid_combinations_raise_clear_errors(ranks) -> None:
    messages = ranks.run(4, facade_errors, timeout=300)
    for m in messages:  # every rank raised the same error (no rank went on into a collective)
        assert m == messages[0]
    m = messages[0]
    assert "prescaled_batch=True" in m["no_prescaled"] and "tensor_parallel_degree=2" in m["no_prescaled"]
    assert "num_key_value_heads=1" in m["kv_heads"] and "[1]" in m["kv_heads"]
    assert "tensor_parallelism=True" in m["not_converted"]
    assert m["converted_first"] == "{'gpt_neox.embed_in.weight': ((96, 32), (48, 32))} []", m["converted_first"]
