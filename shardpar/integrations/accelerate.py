"""shardpar under Hugging Face accelerate: `Accelerator` is accelerate's own, except that a shardpar
model and optimizer pass through `prepare` without DDP, and what a training loop calls on them is
done by shardpar.

    from shardpar.integrations.accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=2, shardpar_config={"sharded_data_parallel_degree": 2})
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

What each accelerate call does with a shardpar model:

- `Accelerator(shardpar_config=...)`: `smp.init(shardpar_config)` unless it already ran; `mixed_precision`
  bf16/fp16 becomes shardpar's (compute copies of the shards; no autocast, no GradScaler on them).
- `prepare(model)`: a plain module is wrapped in `smp.DistributedModel`; a DistributedModel is kept as
  it is (no DDP, no autocast, no device move).
- `prepare(optimizer)`: re-pointed at the shards (`smp.DistributedOptimizer`, fp16 with dynamic loss
  scaling); `optimizer_step_was_skipped` is shardpar's skip (fp16 overflow, non-finite gradients).
- `backward(loss)`: `model.backward(loss / gradient_accumulation_steps)`; the backward ends shardpar's
  accumulation window exactly where accelerate would sync DDP (`sync_gradients`, outside `no_sync`),
  so the replication AllReduce runs there only.
- clipping is accelerate's: `optimizer.step()` does not clip (the `sdp_gradient_clipping` knob is the
  SMP API's); `clip_grad_norm_(model.parameters(), max_norm)` is torch's on the sharded gradients (the
  global norm, one collective; fp16: `DistributedOptimizer.clip_master_grads`, the loss scale divided out).
- `prepare(data loader)`, `gather`, `gather_for_metrics`: split over / gathered from the
  reduced-data-parallel ranks (the ranks of a TP group read one batch).
- `save_state` / `load_state`: accelerate's files for everything else, plus a shardpar partial
  checkpoint in `<dir>/shardpar` (every shard once; resumable at another world size or sdp).
- `save_model(model, dir)`: the full Hugging Face weights and config (shardpar's full export).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
from collections.abc import Iterable, Iterator
from typing import Any

import accelerate
import torch
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import DistributedType, convert_file_size_to_int, recursively_apply
from torch import nn

import shardpar as smp
from shardpar.config import Config
from shardpar.integrations.accelerate_launch import check_before_accelerate
from shardpar.integrations.accelerated import (
    ShardparOptimizer,
    distributed_optimizer,
    optimizes,
    owned,
    shares_parameters,
    take_clipping,
)
from shardpar.integrations.hf_export import save_full_weights
from shardpar.optim.optimizer import DistributedOptimizer
from shardpar.runtime.model import DistributedModel

SHARDPAR_DIR = "shardpar"  # the partial checkpoint inside a save_state directory or a Trainer checkpoint
STATE_TAG = "state"

_ACCELERATOR_INIT = inspect.signature(accelerate.Accelerator.__init__)
_FOREIGN_SHARDING = {
    DistributedType.FSDP: "fsdp_plugin / FSDP",
    DistributedType.DEEPSPEED: "deepspeed_plugin / DeepSpeed",
    DistributedType.MEGATRON_LM: "megatron_lm_plugin / Megatron-LM",
}


class Accelerator(accelerate.Accelerator):
    """`accelerate.Accelerator` that trains a shardpar model (see the module docstring); every other
    object passed to `prepare` is prepared by accelerate as usual."""

    def __init__(self, *args: Any, shardpar_config: Any = None, **kwargs: Any) -> None:
        if shardpar_config is not None and smp.is_initialized():
            raise ValueError(
                "Accelerator(shardpar_config=...) but smp.init() already ran in this process: give the shardpar "
                "configuration once, either to smp.init or here"
            )
        # A bad knob, a plugin or a launch shardpar cannot train with fails here, before accelerate starts a
        # process group ([Note: process counts under accelerate launch] in accelerate_launch.py).
        config = Config.from_any(shardpar_config) if shardpar_config is not None else None
        check_before_accelerate(_ACCELERATOR_INIT.bind_partial(None, *args, **kwargs).arguments, config)
        super().__init__(*args, **kwargs)
        self._check_backend()
        if not smp.is_initialized():
            smp.init(_with_precision(config or Config.from_any(None), self.mixed_precision, initialized=False))
        else:
            _with_precision(smp.get_config(), self.mixed_precision, initialized=True)

    def _check_backend(self) -> None:
        """What accelerate decided from elsewhere (a config file, a device check_before_accelerate could
        not foresee), checked once it has: the same refusals."""
        foreign = _FOREIGN_SHARDING.get(self.distributed_type)
        if foreign is not None or self.is_fsdp2:
            raise ValueError(
                f"Accelerator with {foreign or 'FSDP2'} and shardpar would both shard the model; drop the plugin "
                "(and ACCELERATE_USE_FSDP / ACCELERATE_USE_DEEPSPEED): shardpar's sharded_data_parallel_degree "
                "replaces it"
            )
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if self.num_processes != world:
            raise ValueError(
                f"accelerate sees {self.num_processes} process(es) but the launcher started {world} (WORLD_SIZE): "
                "set ACCELERATE_USE_CPU=1 in the launch environment, or pass Accelerator(cpu=True) "
                "(TrainingArguments(use_cpu=True) for the Trainer), as for DDP on CPUs"
            )

    # ---- the shardpar objects -------------------------------------------------------------------

    def shardpar_model(self) -> DistributedModel | None:
        """The DistributedModel among the prepared models (at most one)."""
        found = [m for m in self._models if isinstance(m, DistributedModel)]
        return found[0] if found else None

    def shardpar_optimizer(self) -> ShardparOptimizer | None:
        found = [o for o in self._optimizers if isinstance(o, ShardparOptimizer)]
        return found[0] if found else None

    def _keep(self, model: nn.Module) -> None:
        if all(m is not model for m in self._models):
            self._models.append(model)

    # ---- prepare --------------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """accelerate's prepare, models first: an optimizer over a model's parameters is re-pointed at
        the shards of the wrapped model, which must exist by then. Results keep the order of `args`."""
        order = sorted(range(len(args)), key=lambda i: not isinstance(args[i], nn.Module))  # stable
        if order == list(range(len(args))):
            return super().prepare(*args, device_placement=device_placement)
        placed = None if device_placement is None else [device_placement[i] for i in order]
        result = super().prepare(*(args[i] for i in order), device_placement=placed)
        done = result if len(args) > 1 else (result,)
        out: list[Any] = [None] * len(args)
        for position, i in enumerate(order):
            out[i] = done[position]
        return tuple(out)

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        if isinstance(model, DistributedModel):
            self._keep(model)  # shardpar owns its placement, precision and gradient reduction
            return model
        owner = self.shardpar_model()
        if owner is not None and shares_parameters(model, owner):
            raise ValueError(
                f"accelerator.prepare got a module ({type(model).__name__}) whose parameters belong to the "
                "DistributedModel already prepared; pass the DistributedModel itself"
            )
        if evaluation_mode or not any(p.requires_grad for p in model.parameters()):
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if owner is not None:
            raise ValueError(
                f"accelerator.prepare got a second trainable model ({type(model).__name__}); shardpar shards one "
                "model per smp.init. Prepare it with evaluation_mode=True, or combine the models into one module"
            )
        wrapped = smp.DistributedModel(model)
        self._keep(wrapped)
        return wrapped

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        if getattr(optimizer, "_is_accelerate_prepared", False):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        model = self.shardpar_model()
        if not isinstance(optimizer, DistributedOptimizer):
            if model is None or not optimizes(optimizer, model):
                return super().prepare_optimizer(optimizer, device_placement=device_placement)
            optimizer = distributed_optimizer(optimizer, model)
        take_clipping(optimizer)
        wrapped = ShardparOptimizer(optimizer)
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_data_loader(
        self, data_loader: torch.utils.data.DataLoader, device_placement: bool | None = None, **kwargs: Any
    ) -> Any:
        """As accelerate, but split over the reduced-data-parallel ranks: with tensor parallelism the
        ranks of a TP group read the same batch (reference 003, prescaled_batch)."""
        if smp.tp_size() == 1 or getattr(data_loader, "_is_accelerate_prepared", False):
            return super().prepare_data_loader(data_loader, device_placement=device_placement, **kwargs)
        if device_placement is None:
            device_placement = self.device_placement
        prepared = prepare_data_loader(
            data_loader,
            self.device,
            num_processes=smp.rdp_size(),
            process_index=smp.rdp_rank(),
            split_batches=self.split_batches,
            put_on_device=device_placement,
            rng_types=self.rng_types.copy(),
            dispatch_batches=self.dispatch_batches,
            even_batches=self.even_batches,
            slice_fn_for_dispatch=kwargs.get("slice_fn_for_dispatch"),
            use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader,
        )
        self._dataloaders.append(prepared)
        return prepared

    # ---- the training step ----------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """For a DistributedModel: its own `no_sync()`, DDP's meaning -- backwards inside do not end the
        accumulation window (no replication AllReduce); the first one outside does. `accumulate(model)`
        comes here too, so a loop that calls `loss.backward()` itself accumulates as under DDP."""
        context = model.no_sync() if isinstance(model, DistributedModel) else super().no_sync(model)
        with context:
            yield

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        model = self.shardpar_model()
        if model is None:
            super().backward(loss, **kwargs)
            return
        if kwargs:
            raise TypeError(
                f"accelerator.backward(loss, {', '.join(sorted(kwargs))}=...): a shardpar model's backward takes the "
                "loss only"
            )
        # accelerate's boundary becomes shardpar's: this backward ends the window iff accelerate would sync
        # (inside no_sync the window itself never ends).
        done = model.window.num_done
        ends = self.sync_gradients
        model.set_backward_passes_per_step(done + 1 if ends else max(model.backward_passes_per_step, done + 2))
        model.backward(loss / self.gradient_accumulation_steps)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2) -> Any:
        params = list(parameters)
        model = self.shardpar_model()
        if model is None or not owned(params, model):
            return super().clip_grad_norm_(params, max_norm, norm_type=norm_type)
        opt = self._optimizer_of(model, "clip_grad_norm_")
        if model.loss_scale == 1.0:
            # accelerate's own call under DDP, on the parameters as the model shows them (their .grad are the
            # sharded gradients; the norm is one collective): the one-process norm and clip, and step() does
            # not clip again ([Note: a user's own clip] in runtime/user_params.py).
            users = [model.user_params.user_of.get(id(p), p) for p in params]
            return torch.nn.utils.clip_grad_norm_(users, max_norm, norm_type=norm_type)
        # fp16: the gradients carry the loss scale, which shardpar divides out (accelerate's unscale_gradients).
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_(norm_type={norm_type!r}) under fp16: shardpar clips by the L2 norm (2)")
        if math.isinf(max_norm):  # the norm only: no clip
            return (opt.grad_norm_squared().sqrt() / model.loss_scale)[0]
        return opt.clip_master_grads(max_norm)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        params = list(parameters)
        model = self.shardpar_model()
        if model is not None and owned(params, model):
            raise ValueError(
                "clip_grad_value_ is not supported on a shardpar model (its gradients are sharded fp32 main "
                "grads); use clip_grad_norm_, or the sdp_gradient_clipping knob"
            )
        super().clip_grad_value_(params, clip_value)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """accelerate's GradScaler never scaled a shardpar optimizer's gradients (shardpar divides its
        own loss scale out inside step and clip_grad_norm_): only the other optimizers are unscaled."""
        chosen = self._optimizers if optimizer is None else optimizer
        chosen = chosen if isinstance(chosen, (list, tuple)) else [chosen]
        plain = [o for o in chosen if not isinstance(o, ShardparOptimizer)]
        if plain:
            super().unscale_gradients(plain)

    def _optimizer_of(self, model: DistributedModel, what: str) -> DistributedOptimizer:
        wrapped = self.shardpar_optimizer()
        if wrapped is None or wrapped.optimizer.model is not model:
            raise ValueError(f"accelerator.{what} on a shardpar model needs its optimizer prepared first")
        inner: DistributedOptimizer = wrapped.optimizer
        return inner

    # ---- gathering (tensor parallelism: one copy per TP group) ----------------------------------

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """As accelerate; with tensor parallelism, one copy per TP group (its ranks read the same batch),
        the duplicates of the last batch dropped as accelerate drops them. `gather` keeps accelerate's
        meaning (every process's tensor, TP copies included: transformers divides its token counts by
        the TP size itself)."""
        tp = smp.tp_size()
        if tp == 1:
            return super().gather_for_metrics(input_data, use_gather_object=use_gather_object)
        if use_gather_object or not _all_tensors(input_data):
            raise ValueError(
                "gather_for_metrics of Python objects with tensor_parallel_degree > 1 is not supported (every TP "
                "rank holds the same batch); gather tensors, or use_gather_object=False"
            )
        world = self.num_processes

        def one_per_tp_group(x: torch.Tensor) -> torch.Tensor:
            # Ranks are TP-major (docs/design.md): rank r is TP rank r % tp; keep TP rank 0's rows.
            return x.reshape(world, -1, *x.shape[1:])[::tp].reshape(-1, *x.shape[1:])

        data = recursively_apply(one_per_tp_group, self.gather(input_data))
        remainder = self.gradient_state.remainder if self.gradient_state.end_of_dataloader else 0
        if remainder > 0:  # the loader (split over the rdp ranks) padded its last batch with repeats
            data = recursively_apply(lambda x: x[:remainder], data)
        return data

    # ---- state ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _without_shardpar(self) -> Iterator[tuple[DistributedModel | None, ShardparOptimizer | None]]:
        """accelerate's own save/load sees everything but the shardpar model and optimizer, whose
        state is every rank's own shard (accelerate would write rank 0's optimizer state only)."""
        model, opt = self.shardpar_model(), self.shardpar_optimizer()
        models: list[Any] = self._models  # type: ignore[has-type]
        optimizers: list[Any] = self._optimizers  # type: ignore[has-type]
        self._models = [m for m in models if m is not model]
        self._optimizers = [o for o in optimizers if o is not opt]
        try:
            yield model, opt
        finally:
            self._models, self._optimizers = models, optimizers

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """accelerate's save_state; the shardpar model and optimizer go to a partial checkpoint in
        `<dir>/shardpar` (every shard once, resumable under another world size or sdp)."""
        with self._without_shardpar() as (model, opt):
            location = str(super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs))
        if model is not None:
            inner = opt.optimizer if opt is not None else None
            smp.save_checkpoint(os.path.join(location, SHARDPAR_DIR), STATE_TAG, model=model, optimizer=inner)
        return location

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        where: list[str] = []
        with self._without_shardpar() as (model, _):
            handle = self.register_load_state_pre_hook(lambda _models, folder: where.append(str(folder)))
            try:
                super().load_state(input_dir, load_kwargs, **kwargs)
            finally:
                handle.remove()
        if model is None:
            return
        path = os.path.join(where[0], SHARDPAR_DIR)
        if not os.path.isdir(path):
            raise ValueError(
                f"load_state({where[0]!r}): no shardpar checkpoint at {path}; save it with this Accelerator"
            )
        if smp.get_topology() is not model.topology:
            raise AssertionError("the prepared DistributedModel belongs to another smp.init")
        smp.resume_from_checkpoint(path, tag=STATE_TAG)

    def save_model(
        self,
        model: nn.Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """For a DistributedModel: its full Hugging Face weights and config (from_pretrained loads
        them), through shardpar's full export; every rank calls it."""
        if not isinstance(model, DistributedModel):
            super().save_model(model, save_directory, max_shard_size=max_shard_size, safe_serialization=True)
            return
        if not safe_serialization:
            raise ValueError("save_model(safe_serialization=False): shardpar writes safetensors only")
        save_full_weights(model, save_directory, max_shard_size=convert_file_size_to_int(max_shard_size))


def _with_precision(config: Config, mixed_precision: str, *, initialized: bool) -> Config:
    """The shardpar Config under accelerate's `mixed_precision`: bf16/fp16 become shardpar's (its
    compute copies; accelerate's autocast and GradScaler are not used on the shardpar model)."""
    have = "bf16" if config.bf16 else "fp16" if config.fp16 else "no"
    if mixed_precision == have or mixed_precision == "no":
        return config
    if mixed_precision not in ("bf16", "fp16"):
        raise ValueError(f"Accelerator(mixed_precision={mixed_precision!r}) is not supported with shardpar; use bf16")
    if initialized or have != "no":
        raise ValueError(
            f"Accelerator(mixed_precision={mixed_precision!r}) but the shardpar config has {have}: shardpar computes "
            f"in its configured precision; set {mixed_precision}=True in the shardpar config, or make them agree"
        )
    return config.replace(**{mixed_precision: True})


def _all_tensors(data: Any) -> bool:
    try:
        recursively_apply(lambda x: x, data, error_on_other_type=True)
    except TypeError:
        return False
    return True
