"""`shardpar demo`: train a tiny Hugging Face GPT-NeoX with sharded data parallelism on local CPU ranks.

The corpus is the source of Python's own standard library (present on every install), tokenised
byte-level, so the demo needs no download.
"""

from __future__ import annotations

import inspect
import resource
import time
from typing import Any

import torch


def corpus_bytes() -> torch.Tensor:
    import argparse
    import collections
    import json

    text = "\n".join(inspect.getsource(m) for m in (argparse, collections, json))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def _batch(data: torch.Tensor, step: int, rank: int, batch: int, seq: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
    ids = torch.stack([data[s : s + seq] for s in starts.tolist()])
    return {"input_ids": ids, "labels": ids.clone()}


def demo_rank(sdp: int, steps: int, batch: int, seq: int) -> dict[str, Any]:
    import transformers
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    import shardpar as smp

    transformers.logging.set_verbosity_error()

    smp.init({"sharded_data_parallel_degree": sdp, "sdp_param_persistence_threshold": 1000})
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(
        vocab_size=256,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = smp.DistributedModel(GPTNeoXForCausalLM(cfg))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
    data = corpus_bytes()
    numel = sum(u.layout.numel for u in model.units) + model.persistent.main.numel()
    history = []
    for step in range(steps):
        start = time.perf_counter()
        loss = model(**_batch(data, step, smp.rdp_rank(), batch, seq)).loss
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        elapsed = time.perf_counter() - start
        mean_loss = sum(smp.allgather(loss.item())) / smp.size()
        history.append(mean_loss)
        if smp.rank() == 0 and (step % 5 == 0 or step == steps - 1):
            tokens = batch * seq * smp.size() / elapsed
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            print(
                f"  step {step:3d}  loss {mean_loss:.3f}  {tokens:7.0f} tokens/s  {elapsed * 1e3:6.0f} ms/step"
                f"  peak RSS rank0 {rss:.0f} MiB",
                flush=True,
            )
    shard = sum(u.main_shard.numel() for u in model.units)
    return {"rank": smp.rank(), "history": history, "numel": numel, "shard": shard}
