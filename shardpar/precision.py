"""Mixed precision: the dtype policy and the fp16 loss scalers.

    bf16 / fp16:  AllGather and compute in the half dtype (half the AllGather bytes); gradients
                  reduced in fp32 by default (`sdp_reduce_dtype`), accumulated and stepped in fp32
                  main shards; compute shards refreshed from the main shards after each step.
    fp16 only:    the loss is scaled (static or dynamic) so small gradients survive fp16; an inf/nan
                  on any rank skips the step everywhere and lowers a dynamic scale.

The dynamic scaler follows the SMP v1 / DeepSpeed `DynamicLossScaler` arguments and update rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardpar.config import Config

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class DtypePolicy:
    compute: torch.dtype  # parameters gathered and used in forward/backward
    reduce: torch.dtype  # gradient ReduceScatter / AllReduce
    main: torch.dtype = torch.float32  # optimizer shards and accumulated gradients

    @classmethod
    def from_config(cls, config: Config) -> DtypePolicy:
        compute = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else torch.float32
        reduce = _DTYPES[config.sdp_reduce_dtype]
        if reduce not in (torch.float32, compute):
            raise ValueError(
                f"sdp_reduce_dtype={config.sdp_reduce_dtype!r} must be 'fp32' or the compute dtype "
                f"({_name(compute)}); set bf16/fp16 accordingly or use 'fp32'"
            )
        return cls(compute=compute, reduce=reduce)

    @property
    def is_mixed(self) -> bool:
        return self.compute != self.main


def _name(dtype: torch.dtype) -> str:
    return next(k for k, v in _DTYPES.items() if v == dtype)


class StaticLossScaler:
    """A fixed scale (1.0 means no scaling)."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        if scale <= 0:
            raise ValueError(f"static_loss_scale={scale} must be > 0")
        self.loss_scale = float(scale)

    def update(self, overflow: bool) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "static", "loss_scale": self.loss_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_scale = float(state["loss_scale"])


class DynamicLossScaler:
    """Halve on overflow (after `delayed_shift` overflows), double after `scale_window` clean steps."""

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
        checks = {
            "init_scale": init_scale > 0,
            "scale_factor": scale_factor > 1,
            "scale_window": scale_window >= 1,
            "min_scale": min_scale > 0,
            "delayed_shift": delayed_shift >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(
                    f"dynamic_loss_args {name}={locals()[name]!r} is out of range "
                    "(init_scale > 0, scale_factor > 1, scale_window >= 1, min_scale > 0, "
                    "delayed_shift >= 1)"
                )
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

    _FIELDS = (
        "loss_scale",
        "scale_factor",
        "scale_window",
        "min_scale",
        "delayed_shift",
        "consecutive_hysteresis",
        "cur_hysteresis",
        "cur_iter",
        "last_overflow_iter",
    )

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "dynamic", **{f: getattr(self, f) for f in self._FIELDS}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in self._FIELDS:
            setattr(self, f, state[f])


LossScaler = StaticLossScaler | DynamicLossScaler

_DYNAMIC_ARGS = {"init_scale", "scale_factor", "scale_window", "min_scale", "delayed_shift", "consecutive_hysteresis"}


def make_loss_scaler(
    policy: DtypePolicy, *, static_loss_scale: float, dynamic_loss_scale: bool, dynamic_loss_args: dict[str, Any] | None
) -> LossScaler:
    """fp16 gets the scaler the user asked for; bf16/fp32 never scale (their range needs none)."""
    if policy.compute != torch.float16:
        return StaticLossScaler(1.0)
    if not dynamic_loss_scale:
        return StaticLossScaler(static_loss_scale)
    args = dict(dynamic_loss_args or {})
    unknown = set(args) - _DYNAMIC_ARGS
    if unknown:
        raise ValueError(f"dynamic_loss_args has unknown keys {sorted(unknown)}; known: {sorted(_DYNAMIC_ARGS)}")
    return DynamicLossScaler(**args)
