"""Fine-tune a small Hugging Face causal LM with the Trainer, sharded by shardpar.

    # 4 local CPU ranks, sharded 2 ways, the tiny GPT-NeoX on Python's own source:
    torchrun --nproc-per-node 4 recipes/hf_trainer/train.py --output_dir runs/hf_trainer --use_cpu \\
        --sdp 2 --max_steps 200 --per_device_train_batch_size 4 --gradient_accumulation_steps 2 \\
        --learning_rate 3e-3 --save_steps 100 --eval_strategy steps --eval_steps 100 --logging_steps 10

    # fine-tune a model you have as a Hugging Face directory (e.g. `shardpar demo`'s export):
    torchrun --nproc-per-node 4 recipes/hf_trainer/train.py --model_name_or_path runs/demo/export/final ...

    # continue after an interruption from the newest checkpoint-N in --output_dir, at any world size:
    torchrun --nproc-per-node 2 recipes/hf_trainer/train.py ... --resume_from_checkpoint true

Every `TrainingArguments` flag works as with transformers' own Trainer (the script is transformers'
usual one; the shardpar lines are marked). `--help` lists them; docs/user-guide.md, section 6, has more.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `recipes` importable from any directory

import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, HfArgumentParser, PreTrainedTokenizerFast, TrainingArguments

from recipes.causal_lm import data, models
from shardpar.integrations.transformers import Trainer  # shardpar: the one changed import


@dataclass
class RecipeArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "a local Hugging Face model directory; default: a fresh tiny GPT-NeoX"}
    )
    size: str = field(default="tiny", metadata={"help": "GPT-NeoX preset when no model is given"})
    seq: int = field(default=128, metadata={"help": "tokens per training sequence"})
    eval_fraction: float = field(default=0.05, metadata={"help": "share of the sequences held out for evaluation"})
    sdp: int = field(default=2, metadata={"help": "shardpar: sharded_data_parallel_degree"})
    smp: str = field(default="{}", metadata={"help": "shardpar: more knobs as JSON, e.g. '{\"bf16\": false}'"})


class Chunks(Dataset[dict[str, torch.Tensor]]):
    """Fixed windows of tokens (one per row of `ids`): a plain map-style dataset the Trainer shuffles."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def datasets(seq: int, eval_fraction: float) -> tuple[Chunks, Chunks, PreTrainedTokenizerFast]:
    """Python's standard-library source, byte-level tokens (on every install, nothing to download), cut
    into windows of `seq` tokens; a seeded `eval_fraction` of them is held out."""
    tokens = data.encode(data.byte_tokenizer(), data.stdlib_texts())
    windows = tokens[: tokens.numel() // seq * seq].view(-1, seq)
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(0))
    held_out = max(1, int(len(windows) * eval_fraction))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=data.byte_tokenizer(), eos_token=data.EOT, pad_token=data.EOT)
    return Chunks(windows[order[held_out:]]), Chunks(windows[order[:held_out]]), tokenizer


def build_model(recipe: RecipeArguments, tokenizer: PreTrainedTokenizerFast) -> torch.nn.Module:
    if recipe.model_name_or_path is not None:
        return AutoModelForCausalLM.from_pretrained(recipe.model_name_or_path)
    config = models.hf_config("gpt_neox", recipe.size, vocab_size=data.model_vocab(tokenizer.backend_tokenizer))
    return models.build(config)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = HfArgumentParser((RecipeArguments, TrainingArguments))  # type: ignore[arg-type]
    recipe, args = parser.parse_args_into_dataclasses(args=argv)
    # shardpar: the sharding configuration (or call smp.init(...) before building the Trainer)
    shardpar_config = {"sharded_data_parallel_degree": recipe.sdp, **json.loads(recipe.smp)}
    train, evaluation, tokenizer = datasets(recipe.seq, recipe.eval_fraction)
    torch.manual_seed(args.seed)  # every rank builds the same model
    trainer = Trainer(
        model=build_model(recipe, tokenizer),
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        shardpar_config=shardpar_config,
    )
    resume = args.resume_from_checkpoint  # a checkpoint directory, or "true": the newest in --output_dir
    trainer.train(resume_from_checkpoint=True if resume in ("true", "True") else resume)
    metrics = trainer.evaluate()
    metrics["eval_perplexity"] = math.exp(min(metrics["eval_loss"], 50.0))
    trainer.save_model()  # full Hugging Face weights in --output_dir: from_pretrained(output_dir) loads them
    if trainer.is_world_process_zero():
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}))
    return metrics


if __name__ == "__main__":
    main()
