"""The command line of train_gpt_simple.py: SMP v1's example options (optimization, I/O, model, smp,
learning rate), with v1's names and defaults."""

from __future__ import annotations

import argparse
import os


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add = parser.add_argument
    # optimization
    add("--train_batch_size", type=int, default=4, help="batch size per dp rank")
    add("--val_batch_size", type=int, default=4)
    add("--max_steps", type=int, default=5000)
    add("--seed", type=int, default=12345)
    add("--same_seed", type=int, default=0)
    add("--fp16", default=0, type=int, help="fp16 training with loss scaling")
    add("--bf16", default=0, type=int, help="bf16 training")
    add("--sharded_data_parallel_degree", default=1, type=int)
    add("--grad_clip", default=1.0, type=float, help="gradient clipping")
    add("--init_loss_scale", default=2.0**32, type=float, help="fp16: the dynamic loss scale to start from")
    add("--weight_decay", default=0.01, type=float)
    add("--beta1", default=0.9, type=float)
    add("--beta2", default=0.95, type=float)
    add("--activation_checkpointing", type=int, default=1)
    add("--logging_freq", type=int, default=1)
    # I/O
    add("--zipped_data", type=int, default=1, help="input data is gzipped JSON lines")
    add("--epochs", type=int, default=3)
    add("--checkpoint-dir", type=str, default="/opt/ml/checkpoints")
    add("--model-dir", type=str, default=os.environ.get("SM_MODEL_DIR", "model"))
    add("--training-dir", type=str, default=os.environ.get("SM_CHANNEL_TRAIN", "data"))
    add("--test-dir", type=str, default=os.environ.get("SM_CHANNEL_TEST", "data"))
    add("--save_final_full_model", type=int, default=0)
    add("--load_partial", type=int, default=0, help="resume from the newest partial checkpoint")
    add("--load_full", type=int, default=0, help="start from a full checkpoint")
    add("--logits_output", type=str, default="", help="file name to save logits and losses to")
    add("--prescaled_batch", type=int, default=1)
    # model
    add("--max_context_width", type=int, default=1024)
    add("--vocab_size", type=int, default=50264)
    add("--hidden_width", type=int, default=768)
    add("--num_layers", type=int, default=12)
    add("--num_heads", type=int, default=12)
    add("--resid_pdrop", type=float, default=0.1)
    add("--embd_pdrop", type=float, default=0.1)
    add("--attn_pdrop", type=float, default=0.1)
    add("--summary_first_pdrop", type=float, default=0.1)
    add("--use_adamw", type=int, default=0)
    # v1's DistributedTransformer replaced HF's blocks; shardpar splits HF's own GPT-2 blocks instead
    add("--use_distributed_transformer", type=int, default=0)
    add("--checkpoint_sublayers", type=int, default=0)
    # smp
    add("--tensor_parallel_degree", type=int, default=1)
    add("--pipeline_parallel_degree", type=int, default=1)
    add("--microbatches", type=int, default=1)
    add("--active_microbatches", type=int, default=None)
    add("--optimize", type=str, default="speed")
    add("--activation_strategy", type=str, default="each")
    add("--shard_optimizer_state", type=int, default=0)
    add("--offload_activations", type=int, default=0)
    add("--fast_mode", type=int, default=0)
    add("--static_mode", type=int, default=0)
    add("--delayed_param", type=int, default=0)
    add("--attention_in_fp32", type=int, default=0)
    add("--placement_strategy", type=str, default="cluster")
    add("--activation_loading_horizon", type=int, default=4)
    add("--skip_tracing", type=int, default=0)
    add("--query_key_layer_scaling", type=int, default=1)
    add("--fused_softmax", type=int, default=1)
    add("--fused_dropout", type=int, default=0)
    add("--fused_bias_gelu", type=int, default=1)
    add("--gradient_accumulation", type=int, default=1)
    add("--manual_partition", type=int, default=0)
    add("--num_kept_checkpoints", type=int, default=5)
    add("--checkpoint_freq", type=int, default=10000)
    add("--validation_freq", type=int, default=None)
    add("--validation_batches", type=int, default=10)
    add("--fast_validation", type=int, default=1)
    add("--enable_memory_profiling", type=int, default=0)
    # learning rate
    add("--lr", type=float, default=None)
    add("--lr_decay_style", type=str, default="linear")
    add("--lr_decay_iters", type=int, default=None)
    add("--min_lr", type=float, default=0.0)
    add("--warmup", type=float, default=0.01)
    add("--plateau", type=float, default=0.4)
    args, _ = parser.parse_known_args(argv)
    return args
