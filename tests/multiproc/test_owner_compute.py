"""Owner compute (issue 31): shape-aware optimizers -- torch.optim.Muon (+AdamW for the rest, in one
DistributedOptimizer), torch.optim.Adafactor, transformers' Adafactor -- train exactly as one process
does, each sharded parameter stepped whole on one owner rank ([Note: owner compute] in
shardpar/optim/owner_compute.py).
"""

from __future__ import annotations

from typing import Any

from tests.multiproc import owner_cases as cases

LOSS_TOL, PARAM_TOL = 1e-5, 5e-5  # fp32, 5 steps with accumulation and clipping
SOS = {"shard_optimizer_state": True}

# Each optimizer at sdp 2 x 2 replicas, sdp 4, tp 2 x sdp 2 or with shard_optimizer_state, spread over
# few cases (the LM ones cost most); Muon on the LM: [Note: Muon's conditioning in parity tests].
PARITY: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    ("muon", "mlp", {"sharded_data_parallel_degree": 4}, {}),
    ("muon", "mlp", {"sharded_data_parallel_degree": 2, **SOS}, {}),
    ("muon_lm", "neox", {"sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2}, {"tp": True}),
    ("adafactor", "neox", {"sharded_data_parallel_degree": 2}, {}),
    ("adafactor", "mlp", {"sharded_data_parallel_degree": 2, **SOS}, {}),
    ("hf_adafactor", "mlp", {"sharded_data_parallel_degree": 4}, {}),
    ("hf_adafactor", "mlp", {"sharded_data_parallel_degree": 2, **SOS}, {}),
]


def test_shape_aware_optimizers_train_exactly_at_world_4(ranks) -> None:
    per_rank = ranks.run(4, cases.run_many, PARITY, timeout=600)
    for (kind, name, knobs, kw), result in zip(PARITY, per_rank[0], strict=True):
        label = f"{kind} {name} {knobs} {kw}"
        assert result["loss"] <= LOSS_TOL, f"{label}: loss diff {result['loss']:.2e}"
        assert result["param"] <= PARAM_TOL, f"{label}: param diff {result['param']:.2e}"
        assert result["clipped"] == 1.0, f"{label}: clipping never engaged"
        assert result["planned"] > 0, f"{label}: nothing was stepped by an owner"
    for i, (kind, name, knobs, _) in enumerate(PARITY):
        owned = sum(r[i]["owned"] for r in per_rank)
        # every owner-stepped parameter has exactly one owner per exchange group (and TP slice)
        members = knobs["sharded_data_parallel_degree"] * (2 if knobs.get("shard_optimizer_state") else 1)
        groups = 4 // members  # exchange groups: each holds every parameter once
        assert all(r[i]["state_elsewhere"] == 0 for r in per_rank), f"{kind} {name}: state on a non-owner"
        assert owned == per_rank[0][i]["planned"] * groups, (kind, name, owned)
