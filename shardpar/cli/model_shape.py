"""The model side of `shardpar estimate`: a model's dimensions and the parameter count of each unit
DistributedModel would build from it (sharding/plan.py), with the persistence split. From an `nn.Module`
(also on the meta device), a Hugging Face config, a bare parameter count, or one of reference 003's
models."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know about a model: dimensions and its units' parameter counts."""

    name: str
    hidden: int
    num_layers: int
    num_heads: int
    vocab: int
    unit_numels: tuple[int, ...]  # sharded elements per unit, root first, then in forward order
    persistent_numel: int
    buffer_bytes: int = 0
    # Per unit: "root", "block" (a repeated layer: saves activations), "embedding" (a large module
    # before the blocks) or "head" (after them; its forward makes the logits). Empty: root + blocks.
    unit_kinds: tuple[str, ...] = ()
    max_tensor_numel: int = 0  # the largest sharded parameter (the optimizer's largest piece x sdp)
    # Per unit, its persistent elements (their gradients appear in its backward). Empty: all in the root.
    unit_persistent: tuple[int, ...] = ()

    @property
    def num_params(self) -> int:
        return sum(self.unit_numels) + self.persistent_numel

    @property
    def persistent_per_unit(self) -> tuple[int, ...]:
        if self.unit_persistent:
            return self.unit_persistent
        return (self.persistent_numel,) + (0,) * (len(self.unit_numels) - 1)

    @property
    def kinds(self) -> tuple[str, ...]:
        if self.unit_kinds:
            return self.unit_kinds
        return ("root",) + ("block",) * (len(self.unit_numels) - 1)


# The models of reference 003's "Reference configurations" as GPT-NeoX config fields. 20B is
# EleutherAI's published layout; the reference gives none for 65B, so it takes LLaMA-65B's width and
# depth (8192 x 80, 64 heads) with GPT-NeoX's 4x MLP: 65.3B parameters.
REFERENCE_MODELS: dict[str, dict[str, Any]] = {
    "gpt-neox-20b": {"hidden_size": 6144, "num_hidden_layers": 44, "num_attention_heads": 64,
                     "intermediate_size": 24576, "rotary_pct": 0.25, "vocab_size": 50432},
    "gpt-neox-65b": {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                     "intermediate_size": 32768, "rotary_pct": 0.25, "vocab_size": 50432},
}  # fmt: skip


def reference_shape(name: str, *, persistence_threshold: int = int(1e6)) -> ModelShape:
    from transformers import GPTNeoXConfig

    if name not in REFERENCE_MODELS:
        raise ValueError(f"unknown reference model {name!r}; choose one of {', '.join(REFERENCE_MODELS)}")
    cfg = GPTNeoXConfig(**REFERENCE_MODELS[name], max_position_embeddings=4096, tie_word_embeddings=False)
    return shape_from_hf_config(cfg, name=name, persistence_threshold=persistence_threshold)


def shape_from_module(module: Any, *, name: str = "model", persistence_threshold: int = int(1e6)) -> ModelShape:
    """Exact unit sizes of an `nn.Module` (may live on the meta device), as DistributedModel splits it."""
    from torch import nn

    from shardpar.sharding.plan import plan_units

    units = plan_units(module, None)
    modules = dict(module.named_modules())
    unit_numels, kinds, smalls, largest = [], [], [], 0
    seen_block = False
    for i, up in enumerate(units):
        small = sum(p.numel() for _, p in up.params if p.numel() < persistence_threshold)
        smalls.append(small)
        unit_numels.append(sum(p.numel() for _, p in up.params) - small)
        largest = max([largest, *(p.numel() for _, p in up.params if p.numel() >= persistence_threshold)])
        parent = modules.get(up.name.rpartition(".")[0])
        block = i > 0 and isinstance(parent, nn.ModuleList)
        seen_block = seen_block or block
        kinds.append("root" if i == 0 else "block" if block else "head" if seen_block else "embedding")
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    cfg = getattr(module, "config", None)
    dims = _dims_of(cfg) if cfg is not None else (0, kinds.count("block"), 1, 0)
    return ModelShape(name, *dims, tuple(unit_numels), sum(smalls), buffers, tuple(kinds), largest, tuple(smalls))


def shape_from_hf_config(config: Any, *, name: str | None = None, persistence_threshold: int = int(1e6)) -> ModelShape:
    """Build the Hugging Face model on the meta device (no memory) and take its exact unit sizes."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(config)
    label = name or str(getattr(config, "model_type", "model"))
    return shape_from_module(module, name=label, persistence_threshold=persistence_threshold)


def shape_from_num_params(
    num_params: float, *, hidden: int | None = None, num_layers: int | None = None, num_heads: int | None = None,
    vocab: int = 50304, persistence_threshold: int = int(1e6),
) -> ModelShape:  # fmt: skip
    """A GPT-like shape for a bare parameter count: per layer 12h^2 weights (4h^2 attention + 8h^2 MLP)
    and 13h biases and layer-norm elements, untied embeddings. The width, when not given, follows the
    GPT-3 family's depth ratio h / layers ~ 128 (or solves for the count at the given depth); the depth,
    when not given, is what the count leaves after the embeddings. Tensors under persistence_threshold
    stay whole on every rank, as DistributedModel keeps them."""
    n = float(num_params)
    if not n > 0:
        raise ValueError(f"num_params={num_params} must be > 0")
    if hidden is None:  # at a given depth L, solve 12 L h^2 + 2 V h = n for h
        hidden = _default_width(n, vocab) if num_layers is None else _round_width(
            (math.sqrt(vocab**2 + 12 * num_layers * n) - vocab) / (12 * num_layers)
        )  # fmt: skip
    if num_layers is None:
        num_layers = _depth_for(n, hidden, vocab)
    h = hidden
    threshold = persistence_threshold
    shape = shape_from_dims(h, num_layers, vocab=vocab, num_heads=num_heads, persistence_threshold=threshold)
    if abs(shape.num_params - n) > 0.1 * n:  # a derived width is rounded to 128: a few percent off at most
        raise ValueError(
            f"num_params={n:.3g} with hidden={h}, num_layers={num_layers}, vocab={vocab} describes "
            f"{shape.num_params:.3g} parameters (12 hidden^2 + 13 hidden per layer, 2 x vocab x hidden "
            f"embeddings), not within 10%; leave hidden or num_layers out to derive it, or give num_params="
            f"{shape.num_params:.3g}"
        )
    return replace(shape, name=f"{shape.num_params / 1e9:.1f}B params")


def shape_from_dims(
    hidden: int, num_layers: int, *, vocab: int = 50304, num_heads: int | None = None,
    persistence_threshold: int = int(1e6),
) -> ModelShape:  # fmt: skip
    """GPT-NeoX's layout (untied embeddings, a 4 x hidden MLP) from its dimensions, split into units as
    DistributedModel splits it (sharding/plan.py): an embedding or LM head holding at least
    OWN_UNIT_NUMEL elements is a unit of its own, else it stays in the root with the final layer norm.
    Arithmetic only (no model is built); tests/unit/test_estimate.py checks it against the real model."""
    from shardpar.sharding.plan import OWN_UNIT_NUMEL

    h = hidden
    # (weight, bias) of the QKV projection, the output projection, MLP up and MLP down; two layer norms
    layer = (3 * h * h, 3 * h, h * h, h, 4 * h * h, 4 * h, 4 * h * h, h, h, h, h, h)
    own = vocab * h >= OWN_UNIT_NUMEL
    root: tuple[int, ...] = (h, h) + (() if own else (vocab * h, vocab * h))  # final layer norm (+ embeddings)
    units = [root, *([(vocab * h,)] if own else []), *([layer] * num_layers), *([(vocab * h,)] if own else [])]
    kinds = ("root", *(["embedding"] if own else []), *(["block"] * num_layers), *(["head"] if own else []))
    if num_layers < 2:  # a list of one layer is not a repeated block: one unit, the root
        units, kinds = [tuple(t for unit in units for t in unit)], ("root",)
    sharded = tuple(sum(t for t in unit if t >= persistence_threshold) for unit in units)
    smalls = tuple(sum(t for t in unit if t < persistence_threshold) for unit in units)
    largest = max((t for unit in units for t in unit if t >= persistence_threshold), default=0)
    heads = num_heads or max(1, h // 128)
    shape = ModelShape("", h, num_layers, heads, vocab, sharded, sum(smalls), 0, kinds, largest, smalls)
    return replace(shape, name=f"GPT-NeoX {h} x {num_layers}, vocab {vocab}")


def _depth_for(n: float, hidden: int, vocab: int) -> int:
    """Layers a count leaves after the embeddings; refuses counts the embeddings alone exceed and shapes
    deeper than they are wide (13e9 at hidden 64 would need some 260,000 layers)."""
    embeddings = 2 * vocab * hidden
    layers = round((n - embeddings) / (12 * hidden * hidden + 13 * hidden))
    if layers < 1:
        raise ValueError(
            f"num_params={n:.3g} does not reach one layer at hidden={hidden}: the embeddings alone (2 x vocab "
            f"{vocab} x hidden) hold {embeddings:.3g}; give a smaller hidden or vocab, or a larger num_params"
        )
    if layers > hidden:
        raise ValueError(
            f"num_params={n:.3g} at hidden={hidden} needs {layers:,} layers, deeper than the model is wide; "
            f"give a wider hidden (the GPT-3 depth ratio gives {_gpt3_width(n)}) or leave it out"
        )
    return layers


def _gpt3_width(n: float) -> int:
    return _round_width((n * 128 / 12) ** (1 / 3))  # 12 h^2 x (h / 128) layers = n


def _default_width(n: float, vocab: int) -> int:
    """The GPT-3 ratio's width, narrowed until the embeddings leave room for a layer (small counts)."""
    h = _gpt3_width(n)
    while h > 128 and 2 * vocab * h + 12 * h * h + 13 * h > n:
        h -= 128
    return h


def _round_width(h: float) -> int:
    return max(128, round(h / 128) * 128)


def _dims_of(cfg: Any) -> tuple[int, int, int, int]:
    def first(*names: str) -> int:
        return int(next((getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None), 0))

    return (
        first("hidden_size", "n_embd", "d_model"),
        first("num_hidden_layers", "n_layer", "num_layers"),
        first("num_attention_heads", "n_head", "num_heads"),
        first("vocab_size"),
    )
