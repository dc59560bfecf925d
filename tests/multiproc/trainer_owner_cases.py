"""Cases for test_hf_trainer.py's `optim="adafactor"` test: transformers' Adafactor chosen by name in
TrainingArguments, through shardpar's Trainer at world 4 (stepped whole on owner ranks, [Note: owner
compute] in shardpar/optim/owner_compute.py) and through transformers' own Trainer on one process.

The recipe is trainer_cases.py's (tiny GPT-NeoX -- here without attention bias, see below -- every
parameter sharded, accumulation 2, max_grad_norm 0.5 engaging, linear schedule) with `optim="adafactor"`:
transformers builds `Adafactor(lr=learning_rate, scale_parameter=False, relative_step=False)` over its
weight-decay groups.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from transformers import GPTNeoXForCausalLM
from transformers import Trainer as HFTrainer

import shardpar as smp
from shardpar.integrations.transformers import Trainer
from tests import models
from tests.multiproc import trainer_cases as tc

ADAFACTOR = {"optim": "adafactor"}


def neox_without_attention_bias() -> nn.Module:
    """tiny GPT-NeoX (models.tiny_neox) without the attention's bias. The key part of that bias has a zero
    gradient in exact arithmetic (it adds the same q.b_k to every score of a query row, which softmax
    ignores), so its computed gradient is rounding noise; transformers' Adafactor (eps 1e-30, which
    TrainingArguments cannot change) steps noise as a full-size update of +-lr. Measured: transformers' own
    Trainer on one process, accumulating 4 x 4 instead of 2 x 8 sequences, moves that bias by 2.9e-2 after
    4 steps -- Adafactor's conditioning, not sharding, which would hide everything a 1e-5 test can see."""
    cfg = models.tiny_neox(0).config
    cfg.attention_bias = False
    torch.manual_seed(0)
    return GPTNeoXForCausalLM(cfg)


def _result(trainer: Any) -> dict[str, Any]:
    inner = trainer.optimizer
    while hasattr(inner, "optimizer"):  # accelerate's and shardpar's wrappers
        inner = inner.optimizer
    return {**tc._history(trainer), "final": tc._full_state(trainer.model), "optimizer": type(inner).__name__}


def reference_adafactor_case(out: str) -> dict[str, Any]:
    trainer = HFTrainer(
        model=neox_without_attention_bias(),
        args=tc.training_args(out, 1, **ADAFACTOR),
        train_dataset=tc.TokenDataset(*tc.TRAIN),
    )
    trainer.train()
    return _result(trainer)


def adafactor_case(out: str) -> dict[str, Any]:
    """shardpar's Trainer, world 4, sdp 2 (2 replicas): what each rank owns and how much state it holds."""
    world = int(os.environ["WORLD_SIZE"])
    try:
        trainer = Trainer(
            model=neox_without_attention_bias(),
            args=tc.training_args(out, world, **ADAFACTOR),
            train_dataset=tc.TokenDataset(*tc.TRAIN),
            shardpar_config=tc.SHARD,
        )
        trainer.train()
        opt = trainer.distributed_optimizer()
        owned = [fqn for fqn, _, mine in opt.owned_leaves() if mine]
        return {**_result(trainer), "owned": owned, "planned": len(opt.owned_leaves()), "sdp": smp.sdp_size()}
    finally:
        smp.shutdown()
