"""fp16 loss scaling: static and dynamic loss scalers, their checkpoint state, and whether a saved state
applies to a resumed run ([Note: loss scaler on resume]).

    fp16 only:    the loss is scaled (static or dynamic) so small gradients survive fp16; an inf/nan
                  on any rank skips the step everywhere and lowers a dynamic scale.

The dynamic scaler follows the SMP v1 / DeepSpeed `DynamicLossScaler` arguments and update rule.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardpar.precision import _DTYPES, DtypePolicy, precision_name


def _number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _as_count(v: Any) -> Any:
    """1000.0 (YAML/JSON configs) or a numpy integer as an int; anything else unchanged, for the check."""
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return int(v)
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_Rule = tuple[Callable[[Any], bool], str]
_STATIC_RULES: dict[str, _Rule] = {"loss_scale": (lambda v: _number(v) and v > 0, "a finite number > 0")}
_DYNAMIC_RULES: dict[str, _Rule] = {
    **_STATIC_RULES,
    "scale_factor": (lambda v: _number(v) and v > 1, "a finite number > 1"),
    "scale_window": (lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    "min_scale": (lambda v: _number(v) and v > 0, "a finite number > 0"),
    "delayed_shift": (lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    "consecutive_hysteresis": (lambda v: isinstance(v, bool), "true or false"),
    "cur_hysteresis": (lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    "cur_iter": (lambda v: _integer(v) and v >= 0, "an integer >= 0"),
    "last_overflow_iter": (lambda v: _integer(v) and v >= -1, "an integer >= -1"),
}
_RULES = {"static": _STATIC_RULES, "dynamic": _DYNAMIC_RULES}


def check_scaler_state(state: Any) -> None:
    """Raise ValueError naming the first malformed field (`loss_scaler.<field>`) of a saved state.

    A state is {"kind": "static" | "dynamic", <the kind's fields>, "precision"?: "fp32" | "bf16" |
    "fp16"}; `precision` (the compute dtype of the run that saved it) is absent in older checkpoints.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"loss_scaler: expected an object, got {type(state).__name__}")
    kind = state.get("kind")
    rules = _RULES.get(kind) if isinstance(kind, str) else None
    if rules is None:
        raise ValueError(f"loss_scaler.kind: {kind!r} is neither 'static' nor 'dynamic'")
    for name, (ok, what) in rules.items():
        if name not in state:
            raise ValueError(f"loss_scaler.{name}: missing (a {kind} scaler's state holds {', '.join(rules)})")
        if not ok(state[name]):
            raise ValueError(f"loss_scaler.{name}: {state[name]!r} is not {what}")
    precision = state.get("precision")
    if precision is not None and precision not in _DTYPES:
        raise ValueError(f"loss_scaler.precision: {precision!r} is not one of {', '.join(_DTYPES)}")


class StaticLossScaler:
    """A fixed scale (1.0 means no scaling)."""

    kind = "static"
    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        if not (_number(scale) and scale > 0):  # nan or inf would make every fp16 step overflow and skip
            raise ValueError(
                f"static_loss_scale={scale!r} must be a finite number > 0 (1.0: no scaling; "
                "dynamic_loss_scale=True for a scale that adapts)"
            )
        self.loss_scale = float(scale)

    def update(self, overflow: bool) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "loss_scale": self.loss_scale}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_kind(state, self.kind)
        self.loss_scale = float(state["loss_scale"])


class DynamicLossScaler:
    """Halve on overflow (after `delayed_shift` overflows), double after `scale_window` clean steps.

    The update rule of SMP v1 and of Megatron-LM / DeepSpeed's `DynamicLossScaler` (before DeepSpeed's
    `stable_interval` rewrite, which grows one clean step later): after an overflow at iteration o
    the scale grows at iteration o + scale_window, i.e. after `scale_window` clean steps. Unlike
    DeepSpeed's default `raise_error_at_min_scale`, an overflow at `min_scale` keeps `min_scale`.
    """

    kind = "dynamic"
    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**32,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 1,
        consecutive_hysteresis: bool = False,
    ) -> None:
        scale_window, delayed_shift = _as_count(scale_window), _as_count(delayed_shift)
        if consecutive_hysteresis in (0, 1):  # 0/1 from a config file
            consecutive_hysteresis = bool(consecutive_hysteresis)
        given = {
            "loss_scale": init_scale,  # the state's name for it, so the state's rules apply
            "scale_factor": scale_factor,
            "scale_window": scale_window,
            "min_scale": min_scale,
            "delayed_shift": delayed_shift,
            "consecutive_hysteresis": consecutive_hysteresis,
        }
        for name, value in given.items():
            ok, what = _DYNAMIC_RULES[name]
            if not ok(value):
                arg = "init_scale" if name == "loss_scale" else name
                raise ValueError(f"dynamic_loss_args {arg}={value!r} must be {what}")
        self.loss_scale = float(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.cur_hysteresis = self.delayed_shift
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.loss_scale = max(self.loss_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.loss_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **{f: getattr(self, f) for f in _DYNAMIC_RULES}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_kind(state, self.kind)
        for name in ("loss_scale", "scale_factor", "min_scale"):
            setattr(self, name, float(state[name]))
        for name in ("scale_window", "delayed_shift", "cur_hysteresis", "cur_iter", "last_overflow_iter"):
            setattr(self, name, int(state[name]))
        self.consecutive_hysteresis = bool(state["consecutive_hysteresis"])


def _check_kind(state: Mapping[str, Any], kind: str) -> None:
    """Validate the whole state before a scaler changes anything."""
    check_scaler_state(state)
    if state["kind"] != kind:
        raise ValueError(f"loss_scaler.kind: a {state['kind']} scaler's state cannot load into a {kind} scaler")


LossScaler = StaticLossScaler | DynamicLossScaler

_DYNAMIC_ARGS = ("init_scale", "scale_factor", "scale_window", "min_scale", "delayed_shift", "consecutive_hysteresis")


def make_loss_scaler(
    policy: DtypePolicy,
    *,
    static_loss_scale: float | None,
    dynamic_loss_scale: bool,
    dynamic_loss_args: dict[str, Any] | None,
) -> LossScaler:
    """fp16 gets the scaler the user asked for; bf16/fp32 never scale (their range needs none).
    `static_loss_scale=None` (SMP v1 scripts pass it next to dynamic_loss_scale=True) means 1.0."""
    static_loss_scale = 1.0 if static_loss_scale is None else static_loss_scale
    args = dict(dynamic_loss_args or {})
    unknown = sorted(set(args) - set(_DYNAMIC_ARGS))
    if unknown:
        hints = [f"{k!r} -> {m[0]!r}" for k in unknown if (m := difflib.get_close_matches(k, _DYNAMIC_ARGS, n=1))]
        raise ValueError(
            f"dynamic_loss_args has unknown keys {unknown}; the known keys are {', '.join(_DYNAMIC_ARGS)}"
            + (f" (did you mean {', '.join(hints)}?)" if hints else "")
        )
    if policy.compute != torch.float16:
        return StaticLossScaler(1.0)
    if not dynamic_loss_scale:
        return StaticLossScaler(static_loss_scale)
    return DynamicLossScaler(**args)


# ---- loss-scaler state on resume ------------------------------------------------------------------


@dataclass(frozen=True)
class ScalerResume:
    """Whether a saved loss-scaler state applies to this run; if not, and it matters, why (one line)."""

    apply: bool
    warning: str | None = None


def _saved_precision(state: Mapping[str, Any]) -> str | None:
    """The precision that saved `state`; None: a run without loss scaling (checkpoints that predate
    the `precision` field and hold a static scale of 1.0)."""
    if state.get("precision") is not None:
        return str(state["precision"])
    return "fp16" if state["kind"] == "dynamic" or float(state["loss_scale"]) != 1.0 else None


def plan_scaler_resume(saved: Mapping[str, Any], scaler: LossScaler, compute: torch.dtype) -> ScalerResume:
    """[Note: loss scaler on resume]
    The saved state is applied only when this run uses fp16 with the same kind of scaler as the
    fp16 run that saved it. Otherwise the current scaler keeps its configured initial state: an
    fp16 checkpoint resumed in bf16/fp32 must not scale the loss (those never do), and an fp32/bf16
    checkpoint holds no fp16 scale to resume. Decided before anything is loaded; a malformed state
    raises ValueError naming the field."""
    check_scaler_state(saved)
    then, now = _saved_precision(saved), precision_name(compute)
    if now == "fp16" and then == "fp16" and saved["kind"] == scaler.kind:
        return ScalerResume(apply=True)
    if now != "fp16" and then != "fp16":
        return ScalerResume(apply=False)  # neither run scales its loss: nothing is lost
    lead = "the saved loss-scaler state was not applied"
    saved_scale = f"{saved['kind']} scaler at {float(saved['loss_scale']):g}"
    starts = f"this fp16 run starts its {scaler.kind} scaler at the configured {scaler.loss_scale:g}"
    if now != "fp16":
        why = f"the checkpoint was saved in fp16 ({saved_scale}) and this {now} run does not scale its loss (1.0)"
    elif then != "fp16":
        why = f"the checkpoint was saved in {then or 'a run without loss scaling'}, which has no fp16 scale; {starts}"
    else:
        why = f"the checkpoint has an fp16 {saved_scale}, not a {scaler.kind} one; {starts}"
    return ScalerResume(apply=False, warning=f"{lead}: {why}")
