"""What the shardpar Trainer accepts: `TrainingArguments` choices it cannot honour are refused at
construction (on every rank alike, before any shardpar work), each named with its fix; the shardpar
configuration is reconciled with the arguments that also say something about it (precision, clipping).
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainingArguments
from transformers.training_args import OptimizerNames

import shardpar as smp
from shardpar.config import Config

# torch optimizers that update each element from that element's gradient and state alone: they step
# this rank's shard exactly as one process steps the whole tensor (docs/design.md, "The optimizer").
ELEMENTWISE_OPTIMIZERS = (
    OptimizerNames.ADAMW_TORCH,
    OptimizerNames.ADAMW_TORCH_FUSED,
    OptimizerNames.SGD,
    OptimizerNames.ADAGRAD,
    OptimizerNames.RMSPROP,
)

_DEFAULT_CLIPPING = Config().sdp_gradient_clipping


class UnsupportedArguments(ValueError):
    """TrainingArguments (or Trainer arguments) shardpar cannot honour; the message lists each with its fix."""


def check_trainer_arguments(args: TrainingArguments, *, model_init: Any) -> None:
    problems = [*_sharding_problems(args), *_precision_and_compile_problems(args), *_optimizer_problems(args)]
    if model_init is not None:
        problems.append(
            "model_init=...: the shardpar Trainer wraps the model it is given once (hyperparameter search rebuilds "
            "it); pass model= instead"
        )
    problems += _launch_problems(args)
    if problems:
        raise UnsupportedArguments("shardpar's Trainer cannot honour these arguments:\n  - " + "\n  - ".join(problems))


def _sharding_problems(args: TrainingArguments) -> list[str]:
    problems = []
    if args.fsdp:
        problems.append(
            f"fsdp={args.fsdp!r}: shardpar shards the model itself; drop fsdp/fsdp_config and set "
            "sharded_data_parallel_degree in the shardpar config (docs/migration.md)"
        )
    if args.deepspeed:
        problems.append(
            f"deepspeed={args.deepspeed!r}: shardpar shards the model itself (ZeRO-3 style, MiCS); drop deepspeed "
            "and set sharded_data_parallel_degree in the shardpar config"
        )
    if getattr(args, "parallelism_config", None) is not None:
        problems.append(
            "parallelism_config=...: accelerate's N-D parallelism; shardpar brings its own (sharded_data_parallel_"
            "degree, tensor_parallel_degree): drop parallelism_config"
        )
    if args.auto_find_batch_size:
        problems.append(
            "auto_find_batch_size=True: it re-wraps the model after an out-of-memory error; set the batch size"
        )
    return problems


def _precision_and_compile_problems(args: TrainingArguments) -> list[str]:
    problems = []
    if args.torch_compile:
        problems.append(
            f"torch_compile=True (backend {args.torch_compile_backend!r}): shardpar's Trainer does not compile the "
            "model yet (a wrapped model compiles in your own loop: docs/user-guide.md section 6); set "
            "torch_compile=False"
        )
    if args.fp16_full_eval or args.bf16_full_eval:
        problems.append(
            "fp16_full_eval/bf16_full_eval=True: it casts the model with .to(dtype), which a sharded model refuses; "
            "evaluate in the training precision (drop the flag)"
        )
    if args.mixed_precision not in ("no", "bf16", "fp16"):
        problems.append(f"mixed_precision={args.mixed_precision!r}: shardpar computes in fp32, bf16 or fp16")
    return problems


# Optimizers that look at whole tensors, stepped whole on one owner rank each ([Note: owner compute] in
# optim/owner_compute.py) with the class and arguments transformers builds: "adafactor" is transformers'
# Adafactor. Other names need packages (bitsandbytes, galore_torch, torchao, ...) or hook into the model's
# backward (lomo, *_layerwise); transformers 5.x has no name for Muon.
OWNER_STEPPED_OPTIMIZERS = (OptimizerNames.ADAFACTOR,)


def _optimizer_problems(args: TrainingArguments) -> list[str]:
    if args.optim in ELEMENTWISE_OPTIMIZERS or args.optim in OWNER_STEPPED_OPTIMIZERS:
        return []
    allowed = ", ".join(o.value for o in (*ELEMENTWISE_OPTIMIZERS, *OWNER_STEPPED_OPTIMIZERS))
    name = OptimizerNames(args.optim).value
    return [
        f"optim={name!r}: shardpar's Trainer runs the optimizers it can step exactly on sharded parameters "
        f"({allowed}); this one needs a package or a hook into the model's backward that shardpar does not "
        "drive. Use one of those names, or build the optimizer yourself and pass "
        "smp.DistributedOptimizer(your_optimizer) to a training loop (docs/user-guide.md, optimizers)"
    ]


def _launch_problems(args: TrainingArguments) -> list[str]:
    world = smp.size() if smp.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if args.world_size == world:
        return []
    return [
        f"TrainingArguments see {args.world_size} process(es) but the launcher started {world} (WORLD_SIZE): "
        "without CUDA, Hugging Face runs each rank alone unless told to use the CPU; pass use_cpu=True, as for DDP "
        "on CPUs"
    ]


def trainer_config(args: TrainingArguments, shardpar_config: Any) -> Config | None:
    """The Config the Trainer passes to `smp.init`, or None when `smp.init` already ran (and agrees).

    The precision comes from `bf16`/`fp16` in the arguments; a shardpar config that names another one
    is refused. `max_grad_norm` drives shardpar's built-in clipping; an explicit sdp_gradient_clipping
    that disagrees is refused."""
    initialized = smp.is_initialized()
    if shardpar_config is not None and initialized:
        raise ValueError(
            "Trainer(shardpar_config=...) but smp.init() already ran in this process: give the shardpar "
            "configuration once, either to smp.init or to the Trainer"
        )
    config = smp.get_config() if initialized else Config.from_any(shardpar_config)
    want = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    have = "bf16" if config.bf16 else "fp16" if config.fp16 else "no"
    if have != want:
        if initialized or have != "no":
            where = "smp.init(...)" if initialized else "the shardpar config"
            raise ValueError(
                f"TrainingArguments ask for precision {want!r} (bf16={args.bf16}, fp16={args.fp16}) but {where} has "
                f"{have!r}: the Trainer takes the precision from TrainingArguments; drop bf16/fp16 from the shardpar "
                "config or make them agree"
            )
        config = config.replace(**{want: True})
    clipping = config.sdp_gradient_clipping
    if clipping not in (_DEFAULT_CLIPPING, args.max_grad_norm):
        raise ValueError(
            f"sdp_gradient_clipping={clipping} in the shardpar config but TrainingArguments(max_grad_norm="
            f"{args.max_grad_norm}): the Trainer clips with max_grad_norm (0 turns it off); drop the knob or make "
            "them agree"
        )
    if config.microbatches != 1:
        raise ValueError(
            f"microbatches={config.microbatches} splits batches inside @smp.step, which the Trainer does not use; "
            "use TrainingArguments(gradient_accumulation_steps=...) instead"
        )
    return None if initialized else config
