"""The fp16 loss scalers and their state on resume, in one process.

The dynamic scaler follows SMP v1 and Megatron-LM / DeepSpeed's `DynamicLossScaler` (the form
before DeepSpeed's `stable_interval` rewrite): halve on overflow once `delayed_shift` overflows were
absorbed, double after `scale_window` clean steps. Two deliberate differences from DeepSpeed 0.19,
pinned below: the scale grows after exactly `scale_window` clean steps (DeepSpeed now waits one
more), and an overflow at `min_scale` keeps `min_scale` instead of raising.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from shardpar.optim.loss_scaling import (
    DynamicLossScaler,
    StaticLossScaler,
    check_scaler_state,
    make_loss_scaler,
    plan_scaler_resume,
)
from shardpar.precision import DtypePolicy

FP16 = DtypePolicy(compute=torch.float16, reduce=torch.float32)
BF16 = DtypePolicy(compute=torch.bfloat16, reduce=torch.float32)
FP32 = DtypePolicy(compute=torch.float32, reduce=torch.float32)


def _trace(scaler: DynamicLossScaler, overflows: list[bool]) -> list[tuple[float, int]]:
    """(scale, cur_hysteresis) after each update."""
    out = []
    for overflow in overflows:
        scaler.update(overflow)
        out.append((scaler.loss_scale, scaler.cur_hysteresis))
    return out


# ---- construction ------------------------------------------------------------------------------


def test_dynamic_defaults_are_smp_v1s() -> None:
    scaler = make_loss_scaler(FP16, static_loss_scale=1.0, dynamic_loss_scale=True, dynamic_loss_args=None)
    assert isinstance(scaler, DynamicLossScaler)
    assert scaler.state_dict() == {
        "kind": "dynamic",
        "loss_scale": 2.0**32,
        "scale_factor": 2.0,
        "scale_window": 1000,
        "min_scale": 1.0,
        "delayed_shift": 1,
        "consecutive_hysteresis": False,
        "cur_hysteresis": 1,
        "cur_iter": 0,
        "last_overflow_iter": -1,
    }


def test_only_fp16_scales_the_loss() -> None:
    static = make_loss_scaler(FP16, static_loss_scale=128.0, dynamic_loss_scale=False, dynamic_loss_args=None)
    assert isinstance(static, StaticLossScaler) and static.loss_scale == 128.0
    for policy in (BF16, FP32):
        scaler = make_loss_scaler(policy, static_loss_scale=128.0, dynamic_loss_scale=True, dynamic_loss_args=None)
        assert isinstance(scaler, StaticLossScaler) and scaler.loss_scale == 1.0


@pytest.mark.parametrize("policy", [FP16, BF16])
def test_unknown_dynamic_loss_args_are_rejected_with_the_known_keys(policy: DtypePolicy) -> None:
    with pytest.raises(ValueError) as err:
        make_loss_scaler(policy, static_loss_scale=1.0, dynamic_loss_scale=True, dynamic_loss_args={"scale_windw": 5})
    message = str(err.value)
    assert "unknown keys ['scale_windw']" in message and "'scale_windw' -> 'scale_window'" in message
    for key in ("init_scale", "scale_factor", "scale_window", "min_scale", "delayed_shift", "consecutive_hysteresis"):
        assert key in message


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ({"init_scale": 0}, "init_scale"),
        ({"scale_factor": 1.0}, "scale_factor"),
        ({"scale_window": 0}, "scale_window"),
        ({"min_scale": 0}, "min_scale"),
        ({"delayed_shift": 0}, "delayed_shift"),
    ],
)
def test_out_of_range_dynamic_loss_args_name_the_argument(args: dict[str, float], name: str) -> None:
    with pytest.raises(ValueError, match=f"dynamic_loss_args {name}="):
        DynamicLossScaler(**args)


# ---- the update rule ---------------------------------------------------------------------------


def test_scale_grows_after_scale_window_clean_steps() -> None:
    scaler = DynamicLossScaler(init_scale=8.0, scale_window=3)
    # clean 0, 1, 2 -> grows at iteration 2; overflow at 3 -> halves; clean 4, 5, 6 -> grows at 6
    scales = [s for s, _ in _trace(scaler, [False, False, False, True, False, False, False])]
    assert scales == [8.0, 8.0, 16.0, 8.0, 8.0, 8.0, 16.0]
    assert (scaler.cur_iter, scaler.last_overflow_iter) == (7, 3)


def test_delayed_shift_absorbs_overflows_and_refills_only_when_the_scale_grows() -> None:
    scaler = DynamicLossScaler(init_scale=1024.0, scale_window=3, delayed_shift=2)
    trace = _trace(scaler, [True, False, True, False, False, False, True])
    assert trace == [
        (1024.0, 1),  # first overflow absorbed
        (1024.0, 1),  # a clean step does not refill (consecutive_hysteresis=False)
        (512.0, 1),  # hysteresis spent: halve
        (512.0, 1),
        (512.0, 1),
        (1024.0, 2),  # 3 clean steps: grow and refill
        (1024.0, 1),  # absorbed again
    ]


def test_consecutive_hysteresis_refills_on_every_clean_step() -> None:
    overflows = [True, False, True, True, True, False, True]
    consecutive = _trace(DynamicLossScaler(init_scale=1024.0, delayed_shift=2, consecutive_hysteresis=True), overflows)
    assert consecutive == [(1024.0, 1), (1024.0, 2), (1024.0, 1), (512.0, 1), (256.0, 1), (256.0, 2), (256.0, 1)]
    plain = _trace(DynamicLossScaler(init_scale=1024.0, delayed_shift=2), overflows)
    assert [s for s, _ in plain] == [1024.0, 1024.0, 512.0, 256.0, 128.0, 128.0, 64.0]


def test_min_scale_is_a_floor_not_an_error() -> None:
    scaler = DynamicLossScaler(init_scale=4.0, min_scale=1.5, scale_window=2)
    assert [s for s, _ in _trace(scaler, [True, True, True, False, False])] == [2.0, 1.5, 1.5, 1.5, 3.0]


def test_static_scaler_never_changes() -> None:
    scaler = StaticLossScaler(64.0)
    for overflow in (True, False, True):
        scaler.update(overflow)
    assert scaler.loss_scale == 64.0
    with pytest.raises(ValueError, match="static_loss_scale=0"):
        StaticLossScaler(0)


@pytest.mark.parametrize(
    ("static", "dynamic_args", "pattern"),
    [
        # nan or inf made every fp16 step overflow and skip, silently
        (float("nan"), None, r"static_loss_scale=nan must be a finite number > 0"),
        (float("inf"), None, r"static_loss_scale=inf must be a finite number > 0"),
        (1.0, {"init_scale": float("inf")}, r"dynamic_loss_args init_scale=inf must be a finite number > 0"),
        (1.0, {"scale_factor": float("nan")}, r"dynamic_loss_args scale_factor=nan must be a finite number > 1"),
        (1.0, {"scale_window": 0}, r"dynamic_loss_args scale_window=0 must be an integer >= 1"),
        (1.0, {"delayed_shift": 1.5}, r"dynamic_loss_args delayed_shift=1.5 must be an integer >= 1"),
    ],
)
def test_scaler_arguments_must_be_finite_and_in_range(static: float, dynamic_args: Any, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        make_loss_scaler(
            FP16, static_loss_scale=static, dynamic_loss_scale=dynamic_args is not None, dynamic_loss_args=dynamic_args
        )


def test_counts_from_config_files_are_accepted() -> None:
    """YAML/JSON give 1000.0 and 0/1; numpy gives its own integers: all were accepted before the checks."""
    import numpy as np

    args = {"scale_window": 1000.0, "delayed_shift": np.int64(2), "consecutive_hysteresis": 0, "init_scale": 2**16}
    scaler = make_loss_scaler(FP16, static_loss_scale=1.0, dynamic_loss_scale=True, dynamic_loss_args=args)
    state = scaler.state_dict()
    assert (state["scale_window"], state["delayed_shift"], state["consecutive_hysteresis"]) == (1000, 2, False)
    assert type(state["scale_window"]) is int and type(state["delayed_shift"]) is int


def test_static_loss_scale_none_means_no_static_scale() -> None:
    """SMP v1 scripts pass static_loss_scale=None next to dynamic_loss_scale=True."""
    dynamic = make_loss_scaler(FP16, static_loss_scale=None, dynamic_loss_scale=True, dynamic_loss_args=None)
    assert dynamic.dynamic
    static = make_loss_scaler(FP16, static_loss_scale=None, dynamic_loss_scale=False, dynamic_loss_args=None)
    assert static.loss_scale == 1.0 and not static.dynamic


# ---- state dicts -------------------------------------------------------------------------------


def test_state_dict_round_trips_through_json_and_behaves_the_same() -> None:
    original = DynamicLossScaler(init_scale=2.0**10, scale_factor=4.0, scale_window=2, min_scale=2.0, delayed_shift=3)
    _trace(original, [True, False, True, True, False])
    restored = DynamicLossScaler()  # other settings: all of them come from the state
    restored.load_state_dict(json.loads(json.dumps(original.state_dict())))
    assert restored.state_dict() == original.state_dict()
    later = [True, False, False, True, True, True, False, False]
    assert _trace(restored, later) == _trace(original, later)

    static = StaticLossScaler(1.0)
    static.load_state_dict(StaticLossScaler(32.0).state_dict())
    assert static.loss_scale == 32.0


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda s: s.pop("cur_iter"), "loss_scaler.cur_iter: missing"),
        (lambda s: s.update(scale_window=2.5), "loss_scaler.scale_window: 2.5 is not an integer >= 1"),
        (lambda s: s.update(loss_scale=float("inf")), "loss_scaler.loss_scale: inf is not a finite number > 0"),
        (lambda s: s.update(consecutive_hysteresis=1), "loss_scaler.consecutive_hysteresis: 1 is not true or false"),
        (lambda s: s.update(kind="adaptive"), "loss_scaler.kind: 'adaptive' is neither"),
        (lambda s: s.update(kind="static"), "loss_scaler.kind: a static scaler's state cannot load"),
    ],
)
def test_malformed_state_names_the_field_and_changes_nothing(change, field: str) -> None:
    state = DynamicLossScaler(init_scale=8.0).state_dict()
    change(state)
    scaler = DynamicLossScaler(init_scale=64.0)
    before = scaler.state_dict()
    with pytest.raises(ValueError) as err:
        scaler.load_state_dict(state)
    assert field in str(err.value)
    assert scaler.state_dict() == before


def test_check_scaler_state_checks_the_precision_field() -> None:
    check_scaler_state({"kind": "static", "loss_scale": 1.0, "precision": "bf16"})
    with pytest.raises(ValueError, match=r"loss_scaler\.precision: 'fp8'"):
        check_scaler_state({"kind": "static", "loss_scale": 1.0, "precision": "fp8"})
    with pytest.raises(ValueError, match="loss_scaler: expected an object"):
        check_scaler_state([1.0])


# ---- which saved state applies on resume -----------------------------------------------------------


def _saved(scaler: StaticLossScaler | DynamicLossScaler, precision: str | None) -> dict[str, object]:
    state = scaler.state_dict()
    return state if precision is None else {**state, "precision": precision}


def test_resume_applies_only_a_matching_fp16_scaler() -> None:
    fp16_dynamic = _saved(DynamicLossScaler(init_scale=2.0**31), "fp16")
    plan = plan_scaler_resume(fp16_dynamic, DynamicLossScaler(), torch.float16)
    assert plan.apply and plan.warning is None
    legacy = _saved(DynamicLossScaler(init_scale=2.0**31), None)  # no precision field: dynamic means fp16
    assert plan_scaler_resume(legacy, DynamicLossScaler(), torch.float16).apply

    to_bf16 = plan_scaler_resume(fp16_dynamic, StaticLossScaler(1.0), torch.bfloat16)
    assert not to_bf16.apply and to_bf16.warning is not None
    assert "not applied" in to_bf16.warning and "fp16" in to_bf16.warning and "bf16" in to_bf16.warning

    from_fp32 = plan_scaler_resume(_saved(StaticLossScaler(1.0), "fp32"), DynamicLossScaler(2.0**10), torch.float16)
    assert not from_fp32.apply and from_fp32.warning is not None
    assert "saved in fp32" in from_fp32.warning and "1024" in from_fp32.warning

    other_kind = plan_scaler_resume(fp16_dynamic, StaticLossScaler(128.0), torch.float16)
    assert not other_kind.apply and other_kind.warning is not None and "not a static one" in other_kind.warning


def test_resume_between_unscaled_precisions_is_silent() -> None:
    for saved in (_saved(StaticLossScaler(1.0), "fp32"), _saved(StaticLossScaler(1.0), None)):
        plan = plan_scaler_resume(saved, StaticLossScaler(1.0), torch.bfloat16)
        assert not plan.apply and plan.warning is None


def test_resume_plan_rejects_a_malformed_state() -> None:
    with pytest.raises(ValueError, match=r"loss_scaler\.loss_scale: missing"):
        plan_scaler_resume({"kind": "static"}, StaticLossScaler(1.0), torch.float16)
