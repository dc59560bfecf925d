"""shard_optimizer_state at any sdp (issue 23): each rank owns 1/(sdp x replicas) of the fp32 main
values, main grads and optimizer state ([Note: replica-sharded main], shardpar/runtime/replica_shard.py).

Parity with single-process training at world 4 (sdp 2 x 2, sdp 1 x 4 = ZeRO-2, tp 2 x 2 replicas) and
world 8 (sdp 2 x 4, sdp 4 x 2); bf16/fp16 bit-identical to the knob off, skipped steps included; the
communication schedule phase by phase; model-state bytes of live tensors against `shardpar estimate`;
resume across on/off, sdp and world sizes; the full export under bf16.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multiproc import parity, tp_cases
from tests.multiproc import replica_shard_cases as cases

TOL = 1e-5  # parity with a single process (fp32)
RESUME_TOL = 1e-6  # a resumed run against the straight one
SHARD = {"sdp_param_persistence_threshold": 10, **cases.ON}

PARITY: dict[int, list[tuple[str, dict[str, Any], dict[str, Any]]]] = {
    4: [
        ("mlp", {**SHARD, "sharded_data_parallel_degree": 2}, {"accum": 2}),
        ("neox", {**SHARD, "sharded_data_parallel_degree": 2, **cases.NATIVE}, {"accum": 2}),
        # sdp 1: ZeRO-2; small buckets, so several carry the replication ReduceScatter during backward
        ("gpt2_tied", {**SHARD, "sharded_data_parallel_degree": 1, "sdp_reduce_bucket_size": 3000}, {"accum": 2}),
        ("mlp", {**SHARD, "sharded_data_parallel_degree": 1, **cases.NATIVE}, {}),
    ],
    8: [
        ("mlp", {**SHARD, "sharded_data_parallel_degree": 2}, {"accum": 2, "steps": 2}),
        ("mlp", {**SHARD, "sharded_data_parallel_degree": 4}, {"accum": 2, "steps": 2}),
    ],
}


def _check_parity(world: int, per_rank: list[list[dict[str, float]]]) -> None:
    for (name, knobs, kw), result in zip(PARITY[world], per_rank[0], strict=True):
        label = f"world {world} {name} {knobs} {kw}"
        replicas = world // knobs["sharded_data_parallel_degree"]
        assert result["loss"] <= TOL, f"{label}: loss diff {result['loss']:.2e}"
        assert result["param"] <= TOL, f"{label}: param diff {result['param']:.2e}"
        assert result["clipped"] == 1.0, f"{label}: clipping never engaged; lower the clip"
        assert result["all_sharded"] == 1.0, f"{label}: units left gathered after the step"
        # the optimizer steps this rank's piece only: at most 1/replicas of its shards
        assert 0 < result["stepped_numel"] <= result["shard_numel"] / replicas, f"{label}: {result}"
    for other in per_rank[1:]:
        assert [r["param"] for r in other] == pytest.approx([r["param"] for r in per_rank[0]], abs=1e-7)


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _check_resumed(label: str, results: list[dict[str, Any]], straight: dict[str, Any], split: bool) -> None:
    for rank, res in enumerate(results):
        where = f"{label} rank {rank}"
        assert res["split"] == split, f"{where}: shard_optimizer_state split={res['split']}"
        assert _diff(res["resumed"], straight["at_save"]) == 0.0, f"{where}: params"
        assert _diff(res["moments"], straight["moments"]) == 0.0, f"{where}: Adam moments"
        losses = max(abs(a - b) for a, b in zip(res["losses"], straight["losses"], strict=True))
        assert losses <= RESUME_TOL, f"{where}: losses differ by {losses:.2e}"
        assert _diff(res["final"], straight["final"]) <= RESUME_TOL, f"{where}: final params"


def test_parity_at_world_4_with_accumulation_clipping_and_tensor_parallelism(ranks) -> None:
    _check_parity(4, ranks.run(4, parity.run_many, PARITY[4], timeout=600))
    # tp 2 x sdp 1 x 2 replicas: TP-split and TP-replicated grads counted once in the norm over the rdp group
    tp = [("parity", "neox", {"sharded_data_parallel_degree": 1, **cases.ON}, {"accum": 2, "steps": 3})]
    result = ranks.run(4, tp_cases.run_many, tp, timeout=600)[0][0]
    for key in ("loss", "norm", "param"):
        assert result[key] <= TOL, f"tp 2: {key} diff {result[key]:.2e}"
    assert result["clipped"] == 1.0 and result["tp_loss_spread"] == 0.0, result


@pytest.mark.parametrize(
    ("precision", "sdp", "knobs"),
    [("bf16", 2, {}), ("fp16", 2, {}), ("bf16", 1, {"sdp_reduce_dtype": "bf16", "sdp_reduce_bucket_size": 100})],
    ids=["bf16", "fp16", "bf16-reduce-sdp1-zero2"],
)
def test_mixed_precision_is_bit_identical_to_the_knob_off_skips_included(
    ranks, precision: str, sdp: int, knobs: dict[str, Any]
) -> None:
    """Accumulation 2, no clipping (see precision_case); rank 3 passes an inf loss at step 2. The
    replicas average alike by AllReduce or ReduceScatter (two of them; or the smddp engine's rank-order
    sums, here at sdp 1 with four replicas and the boundary buckets folded in bf16), and the optimizer is
    element-wise, so every loss, skip, loss scale and final value is the same bit for bit."""
    for rank, res in enumerate(ranks.run(4, cases.precision_case, precision, sdp, knobs, timeout=600)):
        off, on = res["off"], res["on"]
        assert all(on["split"]) and not any(off["split"]), f"rank {rank}: {on['split']} / {off['split']}"
        assert on["skipped"] == off["skipped"] == [False, False, True, False], f"rank {rank}: {on['skipped']}"
        assert on["untouched"] and off["untouched"], f"rank {rank}: the skipped step wrote something"
        assert on["losses"] == off["losses"] and on["scales"] == off["scales"], f"rank {rank}: {on} {off}"
        if precision == "fp16":
            assert on["scales"] == [1024.0, 1024.0, 512.0, 512.0], on["scales"]  # the overflow halved it
        assert _diff(on["state"], off["state"]) == 0.0, f"rank {rank}: final values differ"


@pytest.mark.parametrize(
    ("sdp", "knobs", "itemsize"),
    [(2, cases.NATIVE, 4), (2, {}, 4), (2, {**cases.NATIVE, "bf16": True}, 2), (1, cases.NATIVE, 4)],
    ids=["sdp2-native", "sdp2-smddp", "sdp2-bf16", "sdp1-zero2"],
)
def test_replication_traffic_is_the_allreduce_bytes_as_reduce_scatter_plus_all_gather(
    ranks, sdp: int, knobs: dict[str, Any], itemsize: int
) -> None:
    """Phase by phase, knob on against knob off (2 micro-steps a window, a bucket per unit): the same
    calls everywhere except that the boundary backward ReduceScatters over the replication group what
    the AllReduce took (calls and bytes: per unit, or per bucket at sdp 1), the step AllGathers every
    unit's shard over the replication group in the compute dtype, and the grad norm's one float goes
    over the rdp group instead of the sharding group. Bytes differ only by the padding that rounds each
    shard up to a multiple of the replicas (fewer than `replicas` elements a unit)."""
    off = ranks.run(4, cases.schedule_case, sdp, knobs, timeout=600)[0]
    on = ranks.run(4, cases.schedule_case, sdp, {**knobs, **cases.ON}, timeout=600)[0]
    replicas = on["replicas"]
    assert replicas == 4 // sdp
    assert all(0 <= a - b < replicas for (a, _), (b, _) in zip(on["units"], off["units"], strict=True))
    shard_on, shard_off = (sum(w for w, trainable in run["units"] if trainable) for run in (on, off))
    num_trainable = sum(1 for _, trainable in on["units"] if trainable)
    phases_on = {k: dict(v) for k, v in on["phases"].items()}
    phases_off = {k: dict(v) for k, v in off["phases"].items()}
    allreduce = phases_off["backward 1"].pop(("all_reduce", "replication"))
    assert allreduce["bytes"] == 4 * shard_off, allreduce  # fp32 main grads
    assert phases_on["backward 1"].pop(("reduce_scatter", "replication")) == {
        "calls": allreduce["calls"],
        "bytes": 4 * shard_on,
    }
    assert phases_off["step"].pop(("all_reduce", "sharding")) == {"calls": 1, "bytes": 4}  # the grad norm
    assert phases_on["step"].pop(("all_reduce", "rdp")) == {"calls": 1, "bytes": 4}  # ... over the rdp group
    gather = phases_on["step"].pop(("all_gather", "replication"))
    assert gather == {"calls": num_trainable, "bytes": itemsize * shard_on}  # the AllReduce's, in compute dtype
    for phase, records in phases_off.items():  # nothing else: the same calls, bytes up to the padding
        assert records.keys() == phases_on[phase].keys(), (phase, records, phases_on[phase])
        assert not any(group == "replication" for _, group in records), (phase, records)
        for key, rec in records.items():
            grown = phases_on[phase][key]["bytes"] - rec["bytes"]
            assert phases_on[phase][key]["calls"] == rec["calls"], (phase, key)
            assert 0 <= grown < rec["calls"] * sdp * replicas * 4, (phase, key, grown)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_state_bytes_of_live_tensors_match_the_estimate(ranks, precision: str) -> None:
    """After a step (grads attached), sdp 2 x 2 replicas: every byte the rank keeps, found from the live
    tensors, against `shardpar estimate` -- c x S compute shard + (4 master [mixed] + 4 grad + 8 Adam) x
    S / replicas, persistent parameters whole -- within 5%; and below the knob-off bytes."""
    results = {on: ranks.run(4, cases.memory_case, precision, on, timeout=600) for on in (False, True)}
    for on, per_rank in results.items():
        for rank, r in enumerate(per_rank):
            label = f"{precision} knob {'on' if on else 'off'} rank {rank}"
            assert abs(r["measured"] - r["estimated"]) <= 0.05 * r["estimated"], f"{label}: {r}"
    saving = [off["measured"] - on["measured"] for off, on in zip(results[False], results[True], strict=True)]
    # fp32: grads and Adam state halve (the shard stays: it is the compute copy); bf16: the fp32 master too
    for rank, (off, on) in enumerate(zip(results[False], results[True], strict=True)):
        assert on["measured"] < 0.7 * off["measured"], f"rank {rank}: {on['measured']} vs {off['measured']}"
    assert min(saving) > 0


def test_resume_across_the_knob_sdp_and_world_size(ranks, tmp_path: Path) -> None:
    """Saved with the knob on at world 4 / sdp 2 (every rank writes its own piece: four files), resumed
    off, on at other sdp and at world 2; saved off and resumed on. Resumed values and moments are exact;
    the steps after match the straight run."""
    on_dir, off_dir = str(tmp_path / "on"), str(tmp_path / "off")
    straight = ranks.run(4, cases.save_midway_case, on_dir, 2, cases.ON, timeout=600)[0]
    assert [f for f in straight["files"] if f.startswith("shard-")] == [f"shard-0000{i}.safetensors" for i in range(4)]
    for world, sdp, knobs, split in [(4, 2, {}, False), (4, 1, cases.ON, True), (2, 1, cases.ON, True)]:
        results = ranks.run(world, cases.resume_case, on_dir, sdp, knobs, timeout=600)
        _check_resumed(f"on -> world {world} sdp {sdp} {knobs}", results, straight, split)
    straight_off = ranks.run(4, cases.save_midway_case, off_dir, 2, {}, timeout=600)[0]
    results = ranks.run(2, cases.resume_case, off_dir, 1, cases.ON, timeout=600)
    _check_resumed("off -> world 2 sdp 1 on", results, straight_off, True)


def test_tensor_parallel_checkpoint_stores_each_element_once_and_resumes_anywhere(ranks, tmp_path: Path) -> None:
    """tp 2 x sdp 1 x 2 replicas with the knob (tiny GPT-NeoX): every rank writes its piece, the files hold
    each element of the parameters and both Adam moments once; resumed at tp 2 x sdp 2 without the knob
    and at world 2, tp 1, sdp 1 x 2 replicas with it: exact at the resume, the steps after within 1e-6."""
    root = str(tmp_path)
    straight = ranks.run(4, cases.tp_save_case, root, timeout=600)[0]
    assert [f for f in straight["files"] if f.startswith("shard-")] == [f"shard-0000{i}.safetensors" for i in range(4)]
    hf_numel = sum(t.numel() for t in straight["at_save"]["params"].values())
    assert straight["stored"] == 3 * hf_numel, (straight["stored"], hf_numel)
    for world, tp, sdp, knobs in [(4, 2, 2, {}), (2, 1, 1, cases.ON)]:
        for rank, res in enumerate(ranks.run(world, cases.tp_resume_case, root, tp, sdp, knobs, timeout=600)):
            label = f"world {world} tp {tp} sdp {sdp} {knobs} rank {rank}"
            for what in ("params", "moments"):
                assert _diff(res["resumed"][what], straight["at_save"][what]) == 0.0, f"{label}: resumed {what}"
                assert _diff(res["final"][what], straight["final"][what]) <= RESUME_TOL, f"{label}: final {what}"
            losses = max(abs(a - b) for a, b in zip(res["losses"], straight["losses"], strict=True))
            assert losses <= RESUME_TOL, f"{label}: losses differ by {losses:.2e}"


@pytest.mark.parametrize("sdp", [2, 1])
def test_gradients_kept_across_steps_add_up_as_in_plain_pytorch(ranks, sdp: int) -> None:
    """No zero_grad after a step, then zero_grad(set_to_none=False): the next windows add to this rank's
    piece of the kept gradient (at sdp 1 through the bucket that carries the ReduceScatter)."""
    for rank, res in enumerate(ranks.run(4, cases.kept_grads_case, sdp, timeout=600)):
        assert res["split"] == 1.0 and res["param"] <= TOL, f"rank {rank}: {res}"


def test_world_8_parity(ranks) -> None:
    """sdp 2 x 4 and sdp 4 x 2 replicas against a single process (the checkpoint recipe's global batch of
    4 cannot feed 8 ranks: resuming across world sizes is world 4 <-> 2 above)."""
    _check_parity(8, ranks.run(8, parity.run_many, PARITY[8], timeout=600))


def test_bf16_full_export_and_partial_resume(ranks, tmp_path: Path) -> None:
    """No rank holds a unit's fp32 values under bf16: the export gathers the replicas' pieces on every
    replica, and its tensors are exactly those pieces; the bf16 shards are their cast; a partial
    checkpoint resumes with the knob off into the same values."""
    results = ranks.run(4, cases.bf16_export_case, str(tmp_path), timeout=600)
    r0 = results[0]
    assert r0["export_vs_pieces"] == 0.0 and r0["state_vs_pieces"] == 0.0 and r0["export_keys"], r0
    for rank, r in enumerate(results):
        assert all(r["split"]) and r["compute_vs_pieces"] == 0.0 and r["resumed_vs_saved"] == 0.0, (rank, r)
        gathers = r["gathers"]  # every replica: one replication and one sharding AllGather per unit
        assert gathers[("all_gather", "replication")]["calls"] == gathers[("all_gather", "sharding")]["calls"] == 4
