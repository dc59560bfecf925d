"""A user's own accelerate loop on shardpar's Accelerator (world 4, sdp 2, accumulation 2) against the
same loop in plain PyTorch on one process: losses, clip norms, final weights, evaluation gathered with
gather_for_metrics, the replication AllReduce only at the sync step, save_state / load_state, save_model,
and mixed_precision="bf16" turned into shardpar's bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.multiproc import accelerate_cases as cases

TOL = 1e-5


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_accelerate_loop_matches_one_process_and_resumes_from_save_state(ranks, tmp_path: Path) -> None:
    ref = ranks.run(1, cases.reference_case, timeout=600)[0]
    res = ranks.run(4, cases.loop_case, str(tmp_path), timeout=900)[0]
    straight, resumed = res["straight"], res["resumed"]
    # prepare kept shardpar's objects: no DDP around the model, the optimizer re-pointed at the shards
    assert straight["types"] == ["DistributedModel", "DistributedOptimizer"], straight["types"]
    assert max(abs(a - b) for a, b in zip(straight["losses"], ref["losses"], strict=True)) <= TOL
    assert min(ref["norms"]) < cases.MAX_NORM < max(ref["norms"]), ref["norms"]  # the clip engages, not always
    assert straight["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    assert _max_diff(straight["final"], ref["final"]) <= TOL
    assert (straight["eval_logits"] - ref["eval_logits"]).abs().max().item() <= TOL
    # the replication AllReduce runs in the backward that ends the accumulation window, only there
    per_unit = straight["replication"][1]
    assert per_unit > 0 and straight["replication"] == [0, per_unit] * cases.STEPS, straight["replication"]
    # save_state after 2 steps, a fresh Accelerator, model and optimizer, load_state, 2 more steps
    assert "shardpar" in resumed["files"] and "scheduler.bin" in resumed["files"], resumed["files"]
    assert not any(f.startswith(("model", "optimizer")) for f in resumed["files"]), resumed["files"]
    assert resumed["losses"] == straight["losses"] and resumed["norms"] == straight["norms"]
    assert _max_diff(resumed["final"], straight["final"]) == 0.0
    assert resumed["lr"] == straight["lr"]
    assert straight["export"] <= TOL, "save_model -> from_pretrained"
    mixed = res["bf16"]
    assert mixed["compute"] == "torch.bfloat16" and mixed["config_bf16"], mixed
    assert abs(mixed["losses"][0] - ref["losses"][0]) <= 1e-2, (mixed["losses"], ref["losses"][:2])
