"""GPT-2 pre-training written the SageMaker model-parallel v1 way, modelled on AWS's sharded-data-parallel
example `train_gpt_simple.py`: an `smp_config` options dict, `@smp.step`, `smp.model_creation`,
`smp.set_activation_checkpointing`, fp16 with `optimizer.clip_master_grads`, partial checkpoints with
`smp.save_checkpoint` / `smp.resume_from_checkpoint`, `smp.save`, and v1's rank helpers.

It runs on shardpar with only the imports changed (marked `# v1:` below); everything else is the v1
script's code. For example, 2 CPU ranks, sharded 2 ways, on JSON-lines files of token ids:

    torchrun --nproc-per-node 2 recipes/smp_v1/train_gpt_simple.py --training-dir data --test-dir data \
        --sharded_data_parallel_degree 2 --zipped_data 0 --max_steps 20 --lr 1e-3 --num_layers 4 ...

Where it departs from AWS's script, a comment says why: inputs go to the rank's device (v1's
DistributedModel moved them itself), the model keeps HF's weight initialisation (v1's distributed
transformer replaced it), and the logits/losses record is written with `smp.save`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed
import transformers
from transformers import AutoModelForCausalLM, GPT2Config, set_seed

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `recipes` importable from any directory

import shardpar  # v1: import smdistributed.modelparallel
import shardpar as smp  # v1: import smdistributed.modelparallel.torch as smp
from recipes.smp_v1.args import parse_args
from recipes.smp_v1.data_pipeline import create_pretraining_dataloader
from recipes.smp_v1.learning_rates import AnnealingLR
from recipes.smp_v1.memory_tracker import memory_status, memory_status_cpu
from recipes.smp_v1.sharded_data_parallel_checkpoint import get_buffer_names, get_param_shapes
from shardpar.nn import FusedLayerNorm as LayerNorm  # v1: from smdistributed.modelparallel.torch.nn import ...
from shardpar.nn.huggingface.gpt2 import (  # v1: from smdistributed.modelparallel.torch.nn.huggingface.gpt2 import
    translate_hf_state_dict_to_smdistributed_gpt2,  # noqa: F401  (imported as the v1 script does)
    translate_state_dict_to_hf_gpt2,  # noqa: F401
)


def get_learning_rate_scheduler(optimizer: Any, args: argparse.Namespace) -> AnnealingLR:
    num_iters = max(1, args.lr_decay_iters if args.lr_decay_iters is not None else args.max_steps)
    warmup_iter = args.warmup * num_iters
    return AnnealingLR(
        optimizer,
        start_lr=args.lr,
        warmup_iter=warmup_iter,
        plateau_iter=warmup_iter + args.plateau * num_iters,
        total_iters=num_iters,
        decay_style=args.lr_decay_style,
        min_lr=args.min_lr,
    )


def get_param_groups_by_weight_decay(module: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """Layer norms and biases without weight decay, every other parameter with it."""
    decay: dict[str, Any] = {"params": []}
    no_decay: dict[str, Any] = {"params": [], "weight_decay": 0.0}
    seen: set[int] = set()
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            exempt = isinstance(m, (LayerNorm, torch.nn.LayerNorm)) or name == "bias"
            (no_decay if exempt else decay)["params"].append(p)
    return decay, no_decay


# smdistributed: Define smp.step. Return any tensors needed outside.
@smp.step
def train_step(model: Any, optimizer: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, args: Any) -> Any:
    output = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)
    model.backward(output["loss"])
    return output if args.logits_output else output["loss"]


@smp.step
def test_step(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
    return model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]


def eval_model(model: Any, dataloader: Any, num_batches: int, device: torch.device) -> tuple[float, float]:
    model = model.eval()
    n_batches, loss = 0, torch.zeros((), device=device)
    with torch.no_grad():
        for batch_idx, (input_ids, attention_mask) in enumerate(dataloader):
            if batch_idx >= num_batches:
                break
            loss += test_step(model, input_ids.to(device), attention_mask.to(device)).reduce_mean()
            n_batches += 1
    if n_batches == 0:
        return -1.0, -1.0
    torch.distributed.all_reduce(loss, group=smp.get_dp_process_group())
    mean = loss.item() / smp.dp_size() / n_batches
    return mean, math.exp(mean)


def _paths(directory: str, args: argparse.Namespace) -> list[str]:
    ext = ".json.gz" if args.zipped_data > 0 else ".json"
    return sorted(os.path.join(directory, p) for p in os.listdir(directory) if p.endswith(ext))


def train(
    model: Any,
    optimizer: Any,
    lr_scheduler: AnnealingLR,
    model_config: GPT2Config,
    start_train_path_index: int,
    start_batch_index: int,
    num_params: int,
    total_steps: int,
    args: argparse.Namespace,
) -> tuple[int, float | None, float]:
    if args.enable_memory_profiling > 0:
        memory_status_cpu(msg="before train step")
    model.train()
    # v1's DistributedModel moved step inputs to the GPU itself; here they go to this rank's device.
    device = torch.device("cuda", smp.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    dp_rank = smp.dp_rank() if not args.prescaled_batch else smp.rdp_rank()
    dp_size = smp.dp_size() if not args.prescaled_batch else smp.rdp_size()

    def loader(paths: list[str], batch_size: int, shuffle: bool) -> Any:
        return create_pretraining_dataloader(
            paths, batch_size, args.max_context_width, seed=args.seed, dp_rank=dp_rank, dp_size=dp_size,
            shuffle=shuffle, zipped=args.zipped_data > 0, use_last_file_only=args.fast_validation > 0,
        )  # fmt: skip

    train_paths = _paths(args.training_dir, args)
    train_dataloader = loader([train_paths[start_train_path_index]], args.train_batch_size, args.same_seed < 1)
    if args.validation_freq is not None:
        val_dataloader = loader(_paths(args.test_dir, args), args.val_batch_size, True)

    start = time.time()
    throughput = None
    to_save: dict[str, Any] = {"loss": [], "val_loss": []}
    loss_metric = 0.0

    def grad_accumulation_boundary(batch_idx: int) -> bool:
        return batch_idx % args.gradient_accumulation == args.gradient_accumulation - 1

    def should_record() -> bool:
        # only the ranks in the TP group that holds global rank 0 record
        return 0 in smp.get_tp_group() if smp.tp_size() > 1 else smp.rank() == 0

    set_seed(args.seed)  # the same seed for computation on every rank
    for index in range(start_train_path_index, args.epochs * len(train_paths)):
        next_train_path_index = (index + 1) % len(train_paths)
        curr_train_path_index = index % len(train_paths)
        if total_steps >= args.max_steps:
            break
        for batch_idx, (input_ids, attention_mask) in enumerate(train_dataloader):
            if batch_idx < start_batch_index:
                continue  # resuming: these batches were trained on before the checkpoint
            start_batch_index = 0
            if total_steps >= args.max_steps:
                break
            input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
            step_start = time.time()
            if grad_accumulation_boundary(batch_idx - 1):
                optimizer.zero_grad(set_to_none=True)

            if args.logits_output:
                train_output = train_step(model, optimizer, input_ids, attention_mask, args)
                loss_mb = train_output["loss"]
                logits = torch.cat(tuple(train_output["logits"].outputs), dim=1 if smp.tp_size() > 1 else 0)
            else:
                loss_mb = train_step(model, optimizer, input_ids, attention_mask, args)  # a StepOutput
            loss = loss_mb.reduce_mean()  # smdistributed: average the loss across microbatches
            if not args.validation_freq:
                loss_metric = loss.item()
            if args.enable_memory_profiling > 0:
                memory_status_cpu("After_train_step_cpu")
                memory_status(msg="After_train_step")

            if grad_accumulation_boundary(batch_idx):
                if args.fp16:
                    optimizer.clip_master_grads(args.grad_clip)
                optimizer.step()
                if not (args.fp16 and optimizer.overflow):
                    lr_scheduler.step()
                if args.enable_memory_profiling > 0:
                    memory_status(msg="After_opt_step")

            total_steps += 1
            step_time = time.time() - step_start
            throughput = input_ids.shape[0] * dp_size / step_time
            tflops_per_rank = 8 * num_params * input_ids.numel() / step_time / 1e12
            if smp.rank() == 0 and not total_steps % args.logging_freq:
                print(
                    f"({int(time.time() - start)}s), Batch {total_steps - 1} Loss: {loss.item()}, "
                    f"Speed: {throughput} samples/sec, TFLOPS/GPU: {tflops_per_rank}"
                )

            if args.validation_freq and not total_steps % args.validation_freq:
                val_loss, val_ppl = eval_model(model, val_dataloader, args.validation_batches, device)
                if smp.rank() == 0:
                    print(f"Batch {total_steps - 1} Validation loss: {val_loss} perplexity: {val_ppl}")
                loss_metric = val_loss
                if args.logits_output:
                    to_save["val_loss"].append(val_loss)
                model = model.train()

            if not total_steps % args.checkpoint_freq:
                user_content = {
                    "cli_args": args.__dict__,
                    "num_params": num_params,
                    "total_steps": total_steps,
                    "start_train_path_index": curr_train_path_index,
                    "model_config": model_config,
                    "start_batch_index": batch_idx + 1,
                }
                if args.sharded_data_parallel_degree > 1:  # to reconstruct the full model offline
                    user_content["buffer_names"] = get_buffer_names(model)
                    user_content["param_shapes"] = get_param_shapes(model, optimizer)
                user_content["lr_scheduler"] = lr_scheduler.state_dict()
                smp.save_checkpoint(
                    args.checkpoint_dir,
                    tag=f"total_steps{total_steps}",
                    partial=True,
                    model=model,
                    optimizer=optimizer,
                    user_content=user_content,
                    num_kept_partial_checkpoints=args.num_kept_checkpoints,
                )
            if args.logits_output:
                to_save["loss"].append(loss.item())

        if total_steps >= args.max_steps:
            if should_record() and args.logits_output:
                to_save["logits"] = logits.detach().cpu()
                # v1's script used torch.save here; smp.save writes one file per rank, pickle-free
                path = os.path.join(args.model_dir, f"rank_{smp.rank()}_" + args.logits_output)
                smp.save(to_save, path, partial=True)
                print(f"logits and loss saved at {path}")
            break
        train_dataloader = loader([train_paths[next_train_path_index]], args.train_batch_size, args.same_seed < 1)
    return total_steps, throughput, loss_metric


def compute_num_params(model: torch.nn.Module) -> int:
    return int(sum(np.prod(p.size()) for p in {id(p): p for p in model.parameters()}.values()))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    smp_config = {
        "ddp": True,
        "tensor_parallel_degree": args.tensor_parallel_degree,
        "pipeline_parallel_degree": args.pipeline_parallel_degree,
        "microbatches": args.microbatches,
        "shard_optimizer_state": args.shard_optimizer_state > 0,
        "prescaled_batch": args.prescaled_batch > 0,
        "fp16": args.fp16 > 0,
        "bf16": args.bf16 > 0,
        "offload_activations": args.offload_activations > 0,
        "delayed_parameter_initialization": args.delayed_param > 0,
        "optimize": args.optimize,
        "placement_strategy": args.placement_strategy,
        "activation_loading_horizon": args.activation_loading_horizon,
        "skip_tracing": args.skip_tracing > 0,
        "auto_partition": not args.manual_partition,
        "default_partition": 0,
        "static_mode": args.static_mode > 0,
        "fast_mode": args.fast_mode > 0,
        "sharded_data_parallel_degree": args.sharded_data_parallel_degree,
    }
    if args.active_microbatches is not None:
        smp_config["active_microbatches"] = args.active_microbatches
    smp.init(smp_config)
    if smp.rank() == 0:
        print("Arguments:", args.__dict__)
        print(f"Transformers version: {transformers.__version__}")
        print(f"smdistributed.modelparallel version: {shardpar.__version__}")
        print(f"smdistributed config: {smp_config}")

    model_config = GPT2Config(
        vocab_size=args.vocab_size, n_positions=args.max_context_width, n_embd=args.hidden_width,
        n_layer=args.num_layers, n_head=args.num_heads, n_inner=None, activation_function="gelu_new",
        resid_pdrop=args.resid_pdrop, embd_pdrop=args.embd_pdrop, attn_pdrop=args.attn_pdrop,
        layer_norm_epsilon=1e-05, initializer_range=0.02, summary_first_dropout=args.summary_first_pdrop,
        use_cache=False, bos_token_id=args.vocab_size - 1, eos_token_id=args.vocab_size - 1, return_dict=True,
    )  # fmt: skip
    set_seed(args.seed)
    if args.enable_memory_profiling > 0:
        memory_status_cpu(msg="before model creation")
    if args.fp16 and args.bf16:
        raise ValueError("FP16 and BF16 cannot be simultaneously enabled.")
    dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.get_default_dtype()
    with smp.model_creation(
        tensor_parallelism=smp.tp_size() > 1 or args.use_distributed_transformer > 0,
        dtype=dtype,
        attention_in_fp32=args.attention_in_fp32 > 0,
        query_key_layer_scaling=args.query_key_layer_scaling > 0 and args.bf16 < 1,
        fused_softmax=args.fused_softmax > 0,
        fused_dropout=args.fused_dropout > 0,
        fused_bias_gelu=args.fused_bias_gelu > 0,
    ):
        model = AutoModelForCausalLM.from_config(model_config)
    num_params = compute_num_params(model)
    if smp.rank() == 0:
        print(f"# total parameters: {num_params}")
    if torch.cuda.is_available():
        torch.cuda.set_device(smp.local_rank())
    if not args.same_seed:
        set_seed(args.seed + smp.tp_rank())  # different weights on different TP ranks

    # smdistributed: the DistributedModel container partitions (here: shards) the model; use the
    # returned object for the rest of the script.
    model = smp.DistributedModel(model, trace_device="gpu", backward_passes_per_step=args.gradient_accumulation)
    m: Any = model.get_module()
    transformer_layers = m.transformer.h
    if args.manual_partition:
        for c in transformer_layers.children():
            smp.set_partition(c, 0)  # pipeline_parallel_degree 1: one partition
    param_groups = get_param_groups_by_weight_decay(m)
    optimizer_class = torch.optim.AdamW if args.use_adamw > 0 else torch.optim.Adam
    optimizer: Any = optimizer_class(
        param_groups, betas=(args.beta1, args.beta2), lr=args.lr, weight_decay=args.weight_decay
    )
    if args.activation_checkpointing:
        if args.use_distributed_transformer or smp.tp_size() > 1 or args.activation_strategy != "each":
            smp.set_activation_checkpointing(transformer_layers, strategy=args.activation_strategy)
        else:
            for c in transformer_layers.children():
                if args.checkpoint_sublayers:
                    smp.set_activation_checkpointing(c.attn)
                    smp.set_activation_checkpointing(c.mlp)
                else:
                    smp.set_activation_checkpointing(c)
    optimizer = smp.DistributedOptimizer(
        optimizer,
        static_loss_scale=None,
        dynamic_loss_scale=True,
        dynamic_loss_args={
            "scale_window": 1000,
            "min_scale": 1,
            "delayed_shift": 2,
            "init_scale": args.init_loss_scale,
        },
    )
    lr_scheduler = get_learning_rate_scheduler(optimizer, args)
    if args.enable_memory_profiling > 0:
        model.register_post_partition_hook(lambda model, optimizer: memory_status(msg="After_partition"))

    # load after wrapping model and optimizer with smp Distributed...
    total_steps = start_train_path_index = start_batch_index = 0
    if args.load_full or args.load_partial:
        partial = not args.load_full
        path = args.checkpoint_dir if partial else args.model_dir
        user_content = smp.resume_from_checkpoint(path, tag=None if partial else "fullmodel.pt", partial=partial)
        total_steps = user_content["total_steps"] if partial else 0
        start_train_path_index = user_content.get("start_train_path_index", 0)
        start_batch_index = user_content.get("start_batch_index", 0)
        if "lr_scheduler" in user_content:
            lr_scheduler.load_state_dict(user_content["lr_scheduler"])

    start = time.time()
    total_steps, throughput, loss = train(
        model, optimizer, lr_scheduler, model_config, start_train_path_index, start_batch_index,
        num_params, total_steps, args,
    )  # fmt: skip
    if args.save_final_full_model:
        user_content = {"cli_args": args.__dict__, "num_params": num_params, "total_steps": total_steps}
        user_content["model_config"] = model_config
        if args.sharded_data_parallel_degree > 1:  # v1 saved sharded models partially here too
            user_content["buffer_names"] = get_buffer_names(model)
            user_content["param_shapes"] = get_param_shapes(model, optimizer)
            smp.save_checkpoint(
                args.model_dir, tag=f"sharded_data_parallel_final_full_{num_params}", partial=True,
                model=model, optimizer=optimizer, user_content=user_content,
            )  # fmt: skip
        else:
            smp.save_checkpoint(
                args.model_dir, tag="fullmodel.pt", partial=False, model=model, user_content=user_content
            )
    if smp.rank() == 0:
        print(f"Time to train: {time.time() - start:.1f}s, samples/second: {throughput}, last loss: {loss}")
    smp.barrier()
    if smp.rank() == 0:
        print("SMP training finished successfully")


if __name__ == "__main__":
    main()
