"""The learning-rate schedule of train_gpt_simple.py: linear warm-up, an optional plateau, then a
decay to `min_lr` (constant, linear, cosine, exponential or plateau = constant after the plateau).
Its state goes into the checkpoint's `user_content`."""

from __future__ import annotations

import math
from typing import Any

import torch


class AnnealingLR:
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        start_lr: float,
        warmup_iter: float,
        plateau_iter: float,
        total_iters: int,
        decay_style: str,
        last_iter: int = 0,
        min_lr: float = 0.0,
    ) -> None:
        if decay_style not in ("constant", "linear", "cosine", "exponential", "plateau"):
            raise ValueError(f"decay_style={decay_style!r}: use constant, linear, cosine, exponential or plateau")
        self.optimizer = optimizer
        self.start_lr, self.min_lr = start_lr, min_lr
        self.warmup_iter, self.plateau_iter = int(warmup_iter), int(plateau_iter)
        self.total_iters, self.decay_style = total_iters, decay_style
        self.num_iters = last_iter
        self._apply()

    def get_lr(self) -> float:
        n = self.num_iters
        if self.warmup_iter > 0 and n <= self.warmup_iter:
            return self.start_lr * n / self.warmup_iter
        if n <= self.plateau_iter or self.decay_style in ("constant", "plateau"):
            return self.start_lr
        done = min(1.0, (n - self.plateau_iter) / max(1, self.total_iters - self.plateau_iter))
        if self.decay_style == "linear":
            factor = 1.0 - done
        elif self.decay_style == "cosine":
            factor = 0.5 * (1.0 + math.cos(math.pi * done))
        else:  # exponential: down to 1/e of the way at the end
            factor = math.exp(-done)
        return max(self.min_lr, self.start_lr * factor)

    def step(self) -> None:
        self.num_iters += 1
        self._apply()

    def _apply(self) -> None:
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        return {
            "start_lr": self.start_lr,
            "min_lr": self.min_lr,
            "warmup_iter": self.warmup_iter,
            "plateau_iter": self.plateau_iter,
            "total_iters": self.total_iters,
            "decay_style": self.decay_style,
            "num_iters": self.num_iters,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
        self._apply()
