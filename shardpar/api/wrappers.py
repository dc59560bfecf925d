"""`smp.DistributedModel` and `smp.DistributedOptimizer`: classes, as in SMP v1, so that
`isinstance(model, smp.DistributedModel)` holds. Each subclasses the runtime class it builds
(runtime/model.py, optim/optimizer.py) and adds what the facade does around it: v1's arguments checked,
tensor parallelism prepared, the same-model check, the loss scaler made, and the process-wide state
(context.py) told about the new object.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardpar.api.context import _REGISTERED, _TP_MARKS, state
from shardpar.api.memory import release_freed_memory
from shardpar.api.same_model import check_same_model
from shardpar.api.summary import engine_name, log_owner_compute, log_wrap_summary
from shardpar.checkpoint.partial import prime_fingerprint
from shardpar.checkpoint.torch_state_dict_shim import install as install_torch_state_dict
from shardpar.optim.loss_scaling import make_loss_scaler
from shardpar.optim.optimizer import DistributedOptimizer as _DistributedOptimizer
from shardpar.runtime.materialize import refuse_nested
from shardpar.runtime.model import DistributedModel as _DistributedModel
from shardpar.sharding.plan import WrapPolicy
from shardpar.tensor_parallel.layers import TPLayer, tp_split_table
from shardpar.tensor_parallel.marks import prepare_model as prepare_tensor_parallel

# SMP v1's DistributedModel arguments that tuned its tracer or its DDP wrapper: accepted with their v1
# types, changing nothing here (there is no tracer, and shardpar's reducer is not DDP's).
_V1_MODEL_ARGS: dict[str, tuple[tuple[type, ...], str]] = {
    "trace_device": ((str,), "'cpu' or 'gpu'"),
    "trace_execution_times": ((bool,), "true or false"),
    "trace_memory_usage": ((bool,), "true or false"),
    "overlapping_allreduce": ((bool,), "true or false"),
    "bucket_cap_mb": ((int, float), "a number of MB > 0"),
    "gradient_as_bucket_view": ((bool,), "true or false"),
}


def _check_v1_model_args(args: dict[str, Any]) -> None:
    for name, value in args.items():
        if name not in _V1_MODEL_ARGS:
            raise TypeError(
                f"smp.DistributedModel got an unexpected keyword argument {name!r}; it takes backward_passes_per_step, "
                f"wrap, tensor_parallelism, average_grads_across_microbatches, broadcast_buffers and v1's "
                f"{sorted(_V1_MODEL_ARGS)}"
            )
        types, valid = _V1_MODEL_ARGS[name]
        ok = isinstance(value, types) and (not isinstance(value, bool) or bool in types)
        ok = ok and (name != "trace_device" or value in ("cpu", "gpu")) and (name != "bucket_cap_mb" or value > 0)
        if not ok:
            raise ValueError(f"smp.DistributedModel({name}={value!r}): must be {valid}, as in SageMaker v1")


class DistributedModel(_DistributedModel):
    """Shard `module` over the sharding group (reference 003).

    With `tensor_parallelism=True`, or for a model built under `smp.tensor_parallelism()`, the Hugging
    Face model's blocks and embeddings are first split in place over the TP group; each TP rank then
    shards its local parameters inside its sharding group (docs/tensor_parallelism.md).
    `average_grads_across_microbatches=False` sums the micro-batches' gradients under `@smp.step`
    (SMP v1; for a loss that sums over samples). `broadcast_buffers` (SMP v1 / DDP): rank 0's buffers
    reach every data-parallel rank at wrapping and before each forward that records a graph
    (runtime/buffers.py); False leaves each rank's own. SMP v1's tracer and DDP arguments
    (`trace_device`, `overlapping_allreduce`, `bucket_cap_mb`, ...) are accepted and change nothing.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        backward_passes_per_step: int = 1,
        wrap: WrapPolicy = None,
        tensor_parallelism: bool = False,
        average_grads_across_microbatches: bool = True,
        broadcast_buffers: bool = True,
        **v1_args: Any,
    ) -> None:
        if not isinstance(broadcast_buffers, bool):
            raise ValueError(f"smp.DistributedModel(broadcast_buffers={broadcast_buffers!r}): must be True or False")
        _check_v1_model_args(v1_args)
        if not isinstance(average_grads_across_microbatches, bool):
            raise ValueError(
                f"average_grads_across_microbatches={average_grads_across_microbatches!r} must be True or False"
            )
        st = state()
        if isinstance(module, _DistributedModel):
            raise ValueError("the module is already a DistributedModel; wrap the plain module once")
        refuse_nested(module)  # before any collective reads its (sharded) parameters
        check_same_model(module, st.topology.group("world"))
        module = prepare_tensor_parallel(
            module, requested=tensor_parallelism, marks=_TP_MARKS, topology=st.topology, engine=st.engine
        )
        # what the ranks hold before the wrap frees all but their shards (on meta: nothing)
        held = 0 if _has_meta_tensors(module) else sum(p.numel() * p.element_size() for p in module.parameters())
        super().__init__(
            module.to(st.device) if not _has_meta_tensors(module) else module,
            config=st.config,
            topology=st.topology,
            engine=st.engine,
            entry=st.entry,
            backward_passes_per_step=backward_passes_per_step,
            wrap=wrap,
            registered={id(m): list(ps) for m, ps in _REGISTERED.items()},
            device=st.device,
            premade=[p for m in module.modules() if isinstance(m, TPLayer) for p in m.parameters()],
            average_grads_across_microbatches=average_grads_across_microbatches,
            find_optimizer=lambda: st.optimizer,
            tp_splits=tp_split_table(module) if st.topology.tp.size > 1 else None,
            broadcast_buffers=broadcast_buffers,
        )
        st.model = self
        prime_fingerprint(self)  # the frozen base's CRCs, reused by adapter-only saves ([Note: fingerprint cache])
        install_torch_state_dict()  # torch.distributed.checkpoint.state_dict's functions take it (idempotent)
        log_wrap_summary(self, engine_name(st.engine.name, st.config.ddp_dist_backend))  # rank 0: one INFO record
        release_freed_memory(held)  # the full copies the wrap freed ([Note: hand back what the wrap freed])


def _has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


class DistributedOptimizer(_DistributedOptimizer):
    """Re-point `optimizer` at the local main shards. Clipping (sdp_gradient_clipping) and, with fp16,
    loss scaling run inside step(): static, or dynamic with `dynamic_loss_args` keys init_scale,
    scale_factor, scale_window, min_scale, delayed_shift, consecutive_hysteresis."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
        static_loss_scale: float | None = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict[str, Any] | None = None,
        *,
        model: _DistributedModel | None = None,
    ) -> None:
        st = state()
        model = model or st.model
        if model is None:
            raise ValueError("smp.DistributedOptimizer needs a model: call smp.DistributedModel(model) first")
        scaler = make_loss_scaler(
            model.policy,
            static_loss_scale=static_loss_scale,
            dynamic_loss_scale=dynamic_loss_scale,
            dynamic_loss_args=dynamic_loss_args,
        )
        splits = tp_split_table(model.module) if model.topology.tp.size > 1 else None  # the grad norm's TP rule
        super().__init__(
            optimizer, model, clip_norm=st.config.sdp_gradient_clipping, loss_scaler=scaler, tp_splits=splits
        )
        st.optimizer = self
        log_owner_compute(self)  # rank 0: which ranks step which whole parameters (not element-wise only)
