"""Tensor parallelism by each family's plan (transformers' own for Mistral, Qwen2, Qwen3, Gemma,
GPT-J; hand-written for GPT-Neo, BERT, RoBERTa, T5): tp 2 x sdp 2 trains like one process."""

from __future__ import annotations

import pytest

from tests.multiproc.test_tensor_parallel import SDP2, TOL
from tests.multiproc.tp_cases import run_many
from tests.tp_families import FAMILY_BUILDERS

pytest.importorskip("transformers")

# two AdamW steps each, clipped, one pool case for every family
CASES = [("parity", name, SDP2, {"steps": 2}) for name in FAMILY_BUILDERS]


def test_every_family_trains_like_one_process_at_tp2_sdp2(ranks) -> None:
    per_rank = ranks.run(4, run_many, CASES, timeout=600)
    for (_, name, _, _), result in zip(CASES, per_rank[0], strict=True):
        for key in ("loss", "norm", "param"):
            assert result[key] <= TOL, f"{name}: {key} diff {result[key]:.2e}"
        assert result["tp_loss_spread"] == 0.0, f"{name}: TP ranks computed different losses"
        assert result["clipped"] == 1.0, f"{name}: clipping never engaged; lower the clip"
        assert result["all_sharded"] == 1.0, f"{name}: units left gathered after the step"
        assert result["tp_all_reduces"] > 0 and result["sharding_gathers"] > 0, f"{name}: {result}"
    for other in per_rank[1:]:  # the consolidated model is the same on every rank
        assert [r["param"] for r in other] == pytest.approx([r["param"] for r in per_rank[0]], abs=1e-7)
