"""Small real models for parity tests: an uneven MLP, tiny HF GPT-NeoX, tiny HF GPT-2 (tied embeddings)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class UnevenMLP(nn.Module):
    """Deliberately odd shapes (7, 13, 5), a scalar-ish parameter under any threshold, a ModuleList."""

    def __init__(self, width: int = 13, hidden: int = 7, depth: int = 3, out: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(depth))
        self.head = nn.Linear(width, out)
        self.temperature = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        logits = self.head(h) * self.temperature
        return nn.functional.cross_entropy(logits, y)


def mlp_batch(seed: int, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 13, generator=g), "y": torch.randint(0, 5, (n,), generator=g)}


def tiny_neox(seed: int = 0, layers: int = 2) -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    return GPTNeoXForCausalLM(cfg)


# 32 x 32768 = 2**20 elements: at sharding/plan.py's OWN_UNIT_NUMEL, so the embeddings and the LM
# head are units of their own ([Note: large modules outside the blocks]); the layers stay tiny.
WIDE_VOCAB = 32768


def neox_wide_vocab(seed: int = 0) -> nn.Module:
    """tiny_neox's layers with a vocabulary wide enough for embedding and LM-head units."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(
        vocab_size=WIDE_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False,
    )  # fmt: skip
    return GPTNeoXForCausalLM(cfg)


def wide_vocab_batch(seed: int, n: int) -> dict[str, torch.Tensor]:
    return lm_batch(seed, n, vocab=WIDE_VOCAB)


def tiny_gpt2_tied(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=96,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
    )
    return GPT2LMHeadModel(cfg)


def lm_batch(seed: int, n: int, seq: int = 16, vocab: int = 96) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def train_lm_side_by_side(
    model: Any, opt: Any, ref: nn.Module, ref_opt: Any, *, rank: int, world: int, plain_backward: bool = False
) -> float:
    """Two steps: the sharded `model` on this rank's 2 sequences of each global `lm_batch`, `ref` on all
    of it; the max abs difference of their state dicts afterwards."""
    for step in range(2):
        batch = lm_batch(step, 2 * world)
        loss = model(**{k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}).loss
        if plain_backward:
            loss.backward()
        else:
            model.backward(loss)
        opt.step()
        opt.zero_grad()
        ref(**batch).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return max_param_diff(model, ref)


def sgd_twins(build: Any, lr: float = 0.5) -> tuple[Any, Any, nn.Module, torch.optim.Optimizer]:
    """The same model twice from seed 0 -- smp.DistributedModel with a DistributedOptimizer, and plain
    PyTorch -- both under SGD, which is linear in the gradient: a parity check about which gradients
    get summed with which, free of Adam's conditioning."""
    import shardpar as smp

    torch.manual_seed(0)
    model = smp.DistributedModel(build())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr))
    torch.manual_seed(0)
    ref = build()
    return model, opt, ref, torch.optim.SGD(ref.parameters(), lr=lr)


def adamw_mlp(seed: int) -> tuple[Any, Any]:
    """A wrapped UnevenMLP and its DistributedOptimizer(AdamW) under smp's current init."""
    import shardpar as smp

    torch.manual_seed(seed)
    model = smp.DistributedModel(UnevenMLP())
    return model, smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))


def train_mlp(model: Any, opt: Any, steps: range) -> None:
    for step in steps:
        model.backward(model(**mlp_batch(step, 4)))
        opt.step()
        opt.zero_grad()


def model_and_optimizer_state(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    """Cloned full model state plus the optimizer moments (what a resume must restore exactly)."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pieces = [p for g in opt.optimizer.param_groups for p in g["params"]]
    moments = [v.clone() for p in pieces for k, v in sorted(opt.optimizer.state[p].items()) if k != "step"]
    return {**state, **{f"moment{i}": m for i, m in enumerate(moments)}}


def shard_state(model: Any, opt: Any) -> list[torch.Tensor]:
    """Clones of main shards, compute copies, persistent values and optimizer state: what a skipped
    step must leave bit-identical."""
    out = [u.main_shard.clone() for u in model.units] + [u.compute_shard().clone() for u in model.units]
    out += [model.persistent.main.clone()]
    for state in opt.state.values():
        out += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def same_tensors(a: Any, b: Any) -> bool:
    """Bit-identical: two lists of tensors, or two dicts with the same keys."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def max_param_diff(model: Any, ref: nn.Module) -> float:
    ours, theirs = model.state_dict(), ref.state_dict()
    return max((ours[k] - theirs[k]).abs().max().item() for k in theirs)


class BranchyMLP(UnevenMLP):
    """UnevenMLP whose forward may skip a block or run the blocks in reverse: the unit order changes
    between steps (what eval, generate or data-dependent branches do to a prefetch trace). Mode 3 runs
    every block but detaches block 1's output, so block 1 gets no gradient."""

    def forward(self, x: torch.Tensor, y: torch.Tensor, mode: int = 0) -> torch.Tensor:  # type: ignore[override]
        h = self.inp(x)
        blocks = list(self.blocks)
        if mode == 1:
            blocks = blocks[:1] + blocks[2:]  # skip block 1
        elif mode == 2:
            blocks = blocks[::-1]
        for i, b in enumerate(blocks):
            h = h + 0.0 * b(h).detach() if mode == 3 and i == 1 else b(h)
        return nn.functional.cross_entropy(self.head(h) * self.temperature, y)
