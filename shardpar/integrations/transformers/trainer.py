"""`transformers.Trainer` on a shardpar-sharded model: change the import, keep the script.

    import shardpar as smp
    from shardpar.integrations.transformers import Trainer

    smp.init({"sharded_data_parallel_degree": 2})        # or Trainer(..., shardpar_config={...} or "smp.json")
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=train, eval_dataset=val)
    trainer.train()                                      # torchrun --nproc-per-node N train.py

Each Trainer step goes through shardpar's own API:

- model wrapping: `smp.DistributedModel(model)` at construction (a DistributedModel is taken as it is).
- accelerator: shardpar's Accelerator (integrations/accelerate.py): no DDP; `backward` is
  `model.backward`; the replication AllReduce runs at the gradient-accumulation boundary only.
- optimizer: `args.optim` (the element-wise ones) with Trainer's weight-decay groups by name,
  re-pointed at the shards by `smp.DistributedOptimizer`; the LR scheduler as usual.
- `max_grad_norm`: shardpar's built-in clipping inside `optimizer.step()` (one AllReduce for the norm,
  the clip and the overflow check); the logged `grad_norm` is that norm.
- `bf16` / `fp16`: shardpar's compute copies of the shards (no autocast); fp16 with dynamic loss scaling.
- `checkpoint-N/`: the full HF weights and config (`from_pretrained` loads the folder) -- for a PEFT
  model its adapter as PEFT saves it (`PeftModel.from_pretrained` loads it) --, `shardpar/` (a partial
  checkpoint: every shard once, optimizer state, loss scaler), `scheduler.pt`, `trainer_state.json`,
  `rng_state_*.pth`.
- `resume_from_checkpoint`: the partial checkpoint, resharded to this run's world size and sdp.
- SIGTERM (spot, Kubernetes, SLURM): `checkpoint-<step>` saved at the end of that step on every rank, then
  exit code 143 (`Trainer(..., shardpar_preemption=False)`: the signal's default).
- a torchrun restart (`--max-restarts`, after a rank died) resumes from the newest `checkpoint-N` without
  `resume_from_checkpoint` (auto_resume.py; `Trainer(..., shardpar_auto_resume=False)` opts out).
- data: accelerate's per-rank split, over the reduced-data-parallel ranks (a TP group reads one batch).
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from typing import Any

import torch
import transformers
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn
from transformers import TrainingArguments
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME
from transformers.trainer_pt_utils import reissue_pt_warnings

import shardpar as smp
from shardpar.integrations.accelerate import SHARDPAR_DIR, Accelerator
from shardpar.integrations.accelerated import ShardparOptimizer, distributed_optimizer
from shardpar.integrations.hf_export import save_full_weights
from shardpar.integrations.peft_export import is_peft_model, load_adapter, save_adapter
from shardpar.integrations.transformers.auto_resume import checkpoint_to_resume, restart_count
from shardpar.integrations.transformers.preemption import PreemptionCallback
from shardpar.integrations.transformers.settings import check_trainer_arguments, trainer_config
from shardpar.optim.clipping import TRAINER
from shardpar.optim.optimizer import DistributedOptimizer
from shardpar.runtime.model import DistributedModel

_TRAINER_INIT = inspect.signature(transformers.Trainer.__init__)
OPTIMIZER_NAME = "optimizer.pt"  # what a plain Trainer checkpoint holds instead of shardpar/


class Trainer(transformers.Trainer):
    """`transformers.Trainer` with the same constructor and `TrainingArguments`, plus `shardpar_config`
    (a dict or a JSON/TOML path) when `smp.init` has not run. See the module docstring."""

    def __init__(self, model: Any = None, args: TrainingArguments | None = None, *more: Any, **kwargs: Any) -> None:
        shardpar_config = kwargs.pop("shardpar_config", None)
        preemption = kwargs.pop("shardpar_preemption", True)
        self._auto_resume = bool(kwargs.pop("shardpar_auto_resume", True))
        given = _TRAINER_INIT.bind_partial(None, model, args, *more, **kwargs).arguments
        args = args if args is not None else TrainingArguments(output_dir="tmp_trainer")
        # Refusals first: every rank raises the same error before shardpar does any work.
        check_trainer_arguments(args, model_init=given.get("model_init"))
        config = trainer_config(args, shardpar_config)
        if config is not None:
            smp.init(config)
        wrapped = model if isinstance(model, DistributedModel) else None
        self._steps_zeroed = 0  # optimizer steps whose gradients were cleared (training_step)
        self._accelerator_args: dict[str, Any] = {}
        # transformers inspects the plain model (label names, loss kwargs, config.use_cache) ...
        super().__init__(wrapped.module if wrapped is not None else model, args, *more, **kwargs)
        self._set_signature_columns_if_needed()  # the columns a batch keeps: the plain forward's arguments
        # ... and trains the sharded one.
        if wrapped is None:
            plain = self.model
            if plain is None:
                raise AssertionError("transformers.Trainer refuses a missing model")
            wrapped = smp.DistributedModel(plain, backward_passes_per_step=self.args.gradient_accumulation_steps)
        self.model = self.model_wrapped = wrapped
        self.callback_handler.model = wrapped
        self._preemption = PreemptionCallback() if preemption else None
        if self._preemption is not None:
            self.add_callback(self._preemption)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' train(); with `shardpar_preemption` (default True) SIGTERM saves `checkpoint-<step>`
        at the end of the step on every rank, then exits with smp.PREEMPTED_EXIT_CODE (resume with
        `resume_from_checkpoint=True`). A torchrun restart resumes from the newest checkpoint by itself
        (auto_resume.py) unless `shardpar_auto_resume=False`."""
        if self._auto_resume and not args and kwargs.get("resume_from_checkpoint") is None:
            found = checkpoint_to_resume(self.args.output_dir)
            if found is not None:
                if smp.rank() == 0:
                    print(f"shardpar: restart {restart_count()} of this run: resuming from {found}", flush=True)
                kwargs["resume_from_checkpoint"] = found
        if self._preemption is None:
            return super().train(*args, **kwargs)
        smp.handle_preemption()
        try:
            out = super().train(*args, **kwargs)
            step = self._preemption.preempted_at
            if step is not None:
                smp.exit_preempted(os.path.join(self.args.output_dir or ".", f"checkpoint-{step}"), step)
            return out
        finally:
            smp.stop_handling_preemption()

    # ---- accelerator, model, optimizer ------------------------------------------------------------

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        built: dict[str, Any] = super()._build_accelerator_args(**kwargs)
        self._accelerator_args = built
        return built

    def create_accelerator_and_postprocess(self) -> None:
        # transformers builds and checks a plain Accelerator; shardpar's replaces it, built from the same
        # arguments (the two share accelerate's process-wide state).
        super().create_accelerator_and_postprocess()
        self.accelerator = Accelerator(**self._accelerator_args)
        self.gather_function = functools.partial(
            self.accelerator.gather_for_metrics, use_gather_object=self.args.eval_use_gather_object
        )

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        return model  # wrapped once, at construction

    def get_tp_size(self) -> int:
        return smp.tp_size()

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        # By the names of the wrapped model's own parameters (named_parameters() of a DistributedModel has
        # no "module." prefix; transformers' walk over children would add it).
        names: list[str] = super().get_decay_parameter_names(_unwrap(model))
        return names

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        if isinstance(optimizer, (AcceleratedOptimizer, DistributedOptimizer)):
            return optimizer
        sharded = distributed_optimizer(optimizer, self.sharded_model())
        # Trainer's clipping is shardpar's built-in one (inside step(), sharing the overflow check's AllReduce).
        sharded.set_clipping(float(self.args.max_grad_norm or 0.0), TRAINER)
        self.optimizer = sharded
        return sharded

    def sharded_model(self) -> DistributedModel:
        """The DistributedModel the Trainer trains (`self.model`)."""
        if not isinstance(self.model, DistributedModel):
            raise AssertionError(f"the Trainer's model is {type(self.model).__name__}, not its DistributedModel")
        return self.model

    def distributed_optimizer(self) -> DistributedOptimizer:
        """The shardpar optimizer under accelerate's wrapper."""
        opt = self.optimizer
        while isinstance(opt, AcceleratedOptimizer):
            opt = opt.optimizer
        if not isinstance(opt, DistributedOptimizer):
            raise AssertionError(f"the Trainer's optimizer is {type(opt).__name__}, not a DistributedOptimizer")
        return opt

    # ---- training step ----------------------------------------------------------------------------

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        # transformers clears gradients with model.zero_grad() after each optimizer step; a DistributedModel's
        # gradients live in its shards, which the optimizer clears (until issue 20 makes model.zero_grad do it):
        # before the first backward after a step, whatever happened in between.
        opt = self.distributed_optimizer()
        if opt.num_steps != self._steps_zeroed:
            opt.zero_grad()
            self._steps_zeroed = opt.num_steps
        loss: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)
        return loss

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self._next_grad_norm()  # the clip itself runs inside optimizer.step()

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return grad_norm if grad_norm is not None else self._next_grad_norm()

    def _next_grad_norm(self) -> torch.Tensor:
        if not isinstance(self.optimizer, ShardparOptimizer):
            raise AssertionError("the Trainer's optimizer went through shardpar's Accelerator.prepare")
        return self.optimizer.next_grad_norm()

    # ---- saving -----------------------------------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        """The full HF weights and config through shardpar's export (every rank takes part), or for a
        PEFT model its adapter (integrations/peft_export.py), then what transformers saves next to them
        (tokenizer or processor, training_args.bin)."""
        if state_dict is not None:
            raise ValueError("a shardpar model saves its own full weights: Trainer._save(state_dict=...) is not used")
        directory = output_dir if output_dir is not None else self.args.output_dir
        if directory is None:
            raise ValueError("Trainer._save needs an output_dir (TrainingArguments(output_dir=...))")
        model = self.sharded_model()
        if is_peft_model(model.module):  # what transformers' Trainer saves for PEFT: the adapter alone
            save_adapter(model, directory, is_main_process=self.args.should_save)
        else:
            save_full_weights(model, directory)
        if not self.args.should_save:
            return
        tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
        torch.save(self.args, os.path.join(directory, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The model's shards and the optimizer state as a shardpar partial checkpoint in
        `<output_dir>/shardpar` (resumable at another world size or sdp); the LR scheduler as usual."""
        smp.save_checkpoint(
            os.path.join(output_dir, SHARDPAR_DIR),
            f"step{self.state.global_step}",
            model=self.sharded_model(),
            optimizer=self.distributed_optimizer(),
        )
        if self.args.should_save and self.lr_scheduler is not None:
            with warnings.catch_warnings(record=True) as caught:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            reissue_pt_warnings(caught)

    def _save_scaler(self, output_dir: str) -> None:
        """Nothing: the fp16 loss scaler is shardpar's and lives in the partial checkpoint."""

    # ---- loading ----------------------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """The model's weights, when the checkpoint holds no shardpar partial checkpoint (one saved with
        save_only_model); otherwise the partial checkpoint is loaded together with the optimizer state."""
        if os.path.isdir(os.path.join(resume_from_checkpoint, SHARDPAR_DIR)):
            return  # _load_optimizer_and_scheduler, once the optimizer exists
        if os.path.isfile(os.path.join(resume_from_checkpoint, OPTIMIZER_NAME)):
            raise ValueError(
                f"{resume_from_checkpoint} is a checkpoint of a plain transformers.Trainer: its optimizer state "
                "(optimizer.pt) is one process's and cannot be split into shards. Start from its weights instead: "
                "Trainer(model=AutoModel...from_pretrained(checkpoint), ...) without resume_from_checkpoint"
            )
        self._load_weights(resume_from_checkpoint)

    def _load_weights(self, directory: str) -> None:
        """What `_save` wrote: a PEFT adapter, or the full HF weights."""
        model = self.sharded_model()
        if is_peft_model(model.module):
            load_adapter(model, directory)
        else:
            _load_full_weights(directory)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        partial = os.path.join(checkpoint, SHARDPAR_DIR)
        if not os.path.isdir(partial):
            return  # saved with save_only_model: weights only, as transformers resumes it
        smp.resume_from_checkpoint(partial)  # the model's shards, optimizer state and loss scaler, resharded
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler) and self.lr_scheduler is not None:
            with warnings.catch_warnings(record=True) as caught:
                self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
            reissue_pt_warnings(caught)

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Nothing: the loss scaler came back with the partial checkpoint."""

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None:
            return
        partial = os.path.join(best, SHARDPAR_DIR)
        if os.path.isdir(partial):
            smp.resume_from_checkpoint(partial, load_optimizer=False)
        else:
            self._load_weights(best)


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedModel) else model


def _load_full_weights(directory: str) -> None:
    """A Hugging Face weights directory into the shards (shardpar's full load, tensor by tensor)."""
    root, tag = os.path.split(os.path.normpath(directory))
    smp.resume_from_checkpoint(root, tag=tag, partial=False)
