"""SIGTERM under the Trainer: save a checkpoint at the end of the optimizer step and exit
([Note: preemption at a step boundary] in shardpar/api/preemption.py)."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

import shardpar as smp


class PreemptionCallback(TrainerCallback):
    """After every optimizer step, on every rank (the same step): if any rank got SIGTERM, ask the Trainer
    to save `checkpoint-<step>` now (whatever save_strategy says) and stop; the Trainer then exits."""

    def __init__(self) -> None:
        self.preempted_at: int | None = None

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if smp.preemption_requested():  # one small all-gather per step: every rank gets the same answer
            self.preempted_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
        return control
