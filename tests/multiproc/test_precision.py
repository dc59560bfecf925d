"""bf16/fp16: half-precision compute and AllGather, fp32 main shards, loss scaling, overflow skips;
and delayed initialization."""

from __future__ import annotations

import pytest

from tests.multiproc import precision_cases as cases


def _assert_tracks_fp32(res: dict, *, bound: float = 0.02) -> None:
    """bf16 keeps 8 mantissa bits (relative rounding 2^-9 per op); through 2 layers and tens of Adam
    steps the loss drifts by well under 1% in practice -- 2% is the bound the issue sets."""
    fp32 = res["fp32"]["curve"]
    for key in ("bf16", "bf16_reduce_bf16"):
        curve = res[key]["curve"]
        worst = max(abs(a - b) / b for a, b in zip(curve, fp32, strict=True))
        assert worst <= bound, f"{key}: loss deviates {worst:.2%} from fp32"
        assert res[key]["param_dtypes"] == ["torch.bfloat16"], res[key]["param_dtypes"]  # computes in bf16
        assert res[key]["outside_dtypes"] == ["torch.float32"], res[key]["outside_dtypes"]  # fp32 main params
    assert res["fp32"]["param_dtypes"] == ["torch.float32"]


def _assert_bytes_halved(res: dict, *, reduce_keys: tuple[str, ...]) -> None:
    """bf16 compute halves the AllGathers; sdp_reduce_dtype="bf16" also halves the gradient reductions,
    which stay fp32 (as many bytes as an fp32 run's) with the default sdp_reduce_dtype="fp32"."""
    fp32, bf16, low = (res[k]["bytes"] for k in ("fp32", "bf16", "bf16_reduce_bf16"))
    assert fp32["all_gather/sharding"] > 0
    assert bf16["all_gather/sharding"] * 2 == fp32["all_gather/sharding"] == low["all_gather/sharding"] * 2
    for key in reduce_keys:
        assert fp32[key] > 0, (key, fp32)
        assert bf16[key] == fp32[key], (key, bf16, fp32)
        assert low[key] * 2 == fp32[key], (key, low, fp32)


def test_bf16_tracks_fp32_and_halves_communication_bytes(ranks) -> None:
    res = ranks.run(2, cases.bf16_vs_fp32_case, 30)[0]
    fp32 = res["fp32"]["curve"]
    assert fp32[-1] < 0.8 * fp32[0], "the reference run must actually learn"
    _assert_tracks_fp32(res)
    _assert_bytes_halved(res, reduce_keys=("reduce_scatter/sharding", "all_reduce/rdp"))


def test_bf16_with_replicas_tracks_fp32_and_halves_the_replication_allreduce(ranks) -> None:
    """World 4, sdp 2: two sharding groups, so the boundary AllReduce over the replication group runs."""
    res = ranks.run(4, cases.bf16_vs_fp32_case, 10)[0]
    fp32 = res["fp32"]["curve"]
    assert fp32[-1] < 0.97 * fp32[0], "the reference run must learn"
    _assert_tracks_fp32(res)
    _assert_bytes_halved(res, reduce_keys=("reduce_scatter/sharding", "all_reduce/replication", "all_reduce/rdp"))


def test_bf16_llama_tracks_fp32(ranks) -> None:
    """Llama: rotary over the whole head from an fp32 inv_freq buffer, RMSNorm, grouped-query attention."""
    res = ranks.run(2, cases.bf16_vs_fp32_case, 6, "llama")[0]
    _assert_tracks_fp32(res)
    _assert_bytes_halved(res, reduce_keys=("reduce_scatter/sharding",))


def test_fp16_overflow_skips_everywhere_and_scale_recovers(ranks) -> None:
    results = ranks.run(2, cases.fp16_overflow_case, 24, 12)
    for rank, res in enumerate(results):
        injected = [e for e in res["events"] if e["step"] % 12 == 11]
        for e in injected:
            assert e["overflow"], f"rank {rank} step {e['step']}: overflow not detected"
            assert e["untouched"], f"rank {rank}: params or optimizer state changed on a skipped step"
            assert e["scale_after"] == e["scale_before"] / 2
        clean = [e for e in res["events"] if e["step"] % 12 != 11]
        assert not any(e["overflow"] for e in clean)
        # scale_window=5: the scale doubles after every 5 clean steps
        grew = [e for e in clean if e["scale_after"] == 2 * e["scale_before"]]
        assert [e["step"] for e in grew] == [4, 9, 16, 21], grew
        assert res["scaler_state"]["kind"] == "dynamic" and res["scaler_state"]["loss_scale"] > 0
        assert not res["nan"]
    assert results[0]["events"] == results[1]["events"] or all(
        a["overflow"] == b["overflow"] for a, b in zip(results[0]["events"], results[1]["events"], strict=True)
    )


def test_fp16_overflow_detected_with_static_scale_one_and_no_clipping(ranks) -> None:
    """The overflow check must not depend on clipping or a scale != 1: one AllReduce serves both."""
    for rank, res in enumerate(ranks.run(2, cases.fp16_static_overflow_case)):
        assert not res["clean_overflow"], f"rank {rank}: a clean step reported an overflow"
        assert res["overflow"], f"rank {rank}: the inf injected on rank 1 was not detected"
        assert res["untouched"] and res["num_state_tensors"] > 0, f"rank {rank}: the skipped step changed state"
        assert res["step_collectives"] == [("all_reduce", "sharding")], res["step_collectives"]
        assert res["scale"] == 1.0 and res["recovered"] and res["finite"], res


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_fp16_loss_scale_is_undone_before_clipping_and_the_step(ranks, clip: float) -> None:
    """Same run with static scale 1 and 1024: same unscaled grad norm, same SGD update. Power-of-two
    scaling is exact in fp16 except where scale 1 underflows small gradients, hence 1% and not 0."""
    plain, scaled = (ranks.run(2, cases.fp16_loss_scale_case, clip, scale)[0] for scale in (1.0, 1024.0))
    assert not plain["overflow"] and not scaled["overflow"]
    for a, b in zip(plain["norms"], scaled["norms"], strict=True):
        assert abs(a - b) <= 0.01 * a, (plain["norms"], scaled["norms"])
    diff = max(abs(a - b) for a, b in zip(plain["update"], scaled["update"], strict=True))
    size = max(abs(a) for a in plain["update"])
    assert size > 0 and diff <= 0.01 * size, (diff, size)
    if clip:  # the clip really clipped: every step's norm is above it
        assert min(plain["norms"]) > clip, plain["norms"]


def test_a_growing_dynamic_scale_undoes_the_scale_the_gradients_carry(ranks) -> None:
    """A dynamic scaler that grows after every clean step (1024, 2048, 4096, ...) against a static 1024:
    the same grad norms and SGD update. Unscaling by the grown scale instead of the one the backward
    used halved every step that grew it."""
    static, dynamic = (ranks.run(2, cases.fp16_loss_scale_case, 0.0, 1024.0, 3, grows)[0] for grows in (False, True))
    assert not static["overflow"] and not dynamic["overflow"]
    assert dynamic["final_scale"] == 1024.0 * 2**3, dynamic["final_scale"]  # it really grew every step
    for a, b in zip(static["norms"], dynamic["norms"], strict=True):
        assert abs(a - b) <= 0.01 * a, (static["norms"], dynamic["norms"])
    diff = max(abs(a - b) for a, b in zip(static["update"], dynamic["update"], strict=True))
    size = max(abs(a) for a in static["update"])
    assert size > 0 and diff <= 0.01 * size, (diff, size)


@pytest.mark.slow
def test_fp16_200_steps_with_periodic_overflow_never_nan(ranks) -> None:
    for res in ranks.run(2, cases.fp16_overflow_case, 200, 7):
        assert not res["nan"]
        assert sum(e["overflow"] for e in res["events"]) == 200 // 7


def test_delayed_initialization_equals_normal_init(ranks) -> None:
    for res in ranks.run(2, cases.delayed_init_case):
        assert res == {"meta_before": True, "no_full": True, "exact": True, "finite": True}


def test_init_empty_weights_materialises_consistently(ranks) -> None:
    for res in ranks.run(2, cases.init_empty_weights_case):
        assert (res["finite"], res["same"], res["nonzero"]) == (True, True, True)
        assert "'temperature' belongs to UnevenMLP" in res["error"] and "deferred_init()" in res["error"]
