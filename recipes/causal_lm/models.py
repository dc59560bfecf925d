"""Named model sizes per family, built from `transformers` configs (no download).

The GPT-NeoX 20B and 65B layouts are the models of reference 003's "Reference configurations"
(`shardpar.cli.estimate.REFERENCE_MODELS`, where the 65B choice is explained).
"""

from __future__ import annotations

from typing import Any

from shardpar.cli.estimate import REFERENCE_MODELS

# family -> size -> (config kwargs, default learning rate)
SIZES: dict[str, dict[str, tuple[dict[str, Any], float]]] = {
    "gpt_neox": {
        "tiny": (
            {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 512},
            3e-3,
        ),
        "160m": (
            {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
            6e-4,
        ),
        "410m": (
            {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096},
            3e-4,
        ),
        "1.4b": (
            {"hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 8192},
            2e-4,
        ),
        "6.9b": (
            {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 16384},
            1.2e-4,
        ),
        "20b": ({**REFERENCE_MODELS["gpt-neox-20b"]}, 1e-4),
        "65b": ({**REFERENCE_MODELS["gpt-neox-65b"]}, 8e-5),
    },
    "llama": {
        "tiny": (
            {
                "hidden_size": 128,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 352,
            },
            3e-3,
        ),
        "1b": (
            {
                "hidden_size": 2048,
                "num_hidden_layers": 22,
                "num_attention_heads": 32,
                "num_key_value_heads": 4,
                "intermediate_size": 5632,
            },
            4e-4,
        ),
        "7b": (
            {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 11008},
            3e-4,
        ),
        "13b": (
            {"hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 40, "intermediate_size": 13824},
            3e-4,
        ),
        "65b": (
            {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64, "intermediate_size": 22016},
            1.5e-4,
        ),
    },
    "gpt2": {
        "tiny": ({"n_embd": 128, "n_layer": 4, "n_head": 4}, 3e-3),
        "124m": ({"n_embd": 768, "n_layer": 12, "n_head": 12}, 6e-4),
        "355m": ({"n_embd": 1024, "n_layer": 24, "n_head": 16}, 3e-4),
        "774m": ({"n_embd": 1280, "n_layer": 36, "n_head": 20}, 2.5e-4),
        "1.5b": ({"n_embd": 1600, "n_layer": 48, "n_head": 25}, 2e-4),
    },
}

_DEFAULT_VOCAB = {"gpt_neox": 50304, "llama": 32000, "gpt2": 50257}
_DEFAULT_POSITIONS = {"gpt_neox": 2048, "llama": 4096, "gpt2": 1024}
_NO_DROPOUT = {
    "gpt_neox": {"hidden_dropout": 0.0, "attention_dropout": 0.0, "tie_word_embeddings": False},
    "llama": {"attention_dropout": 0.0, "tie_word_embeddings": False},
    "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": True},
}


def preset(family: str, size: str) -> tuple[dict[str, Any], float]:
    sizes = SIZES.get(family)
    if sizes is None:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(SIZES)}")
    if size not in sizes:
        raise ValueError(f"unknown size {size!r} for {family}; choose one of {', '.join(sizes)}")
    return sizes[size]


def hf_config(family: str, size: str, *, vocab_size: int | None = None, seq: int | None = None) -> Any:
    """The transformers config of a named size; `vocab_size` (the tokenizer's) and `seq` override."""
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig

    kwargs, _ = preset(family, size)
    kw = {"vocab_size": _DEFAULT_VOCAB[family], **_NO_DROPOUT[family], **kwargs}
    if vocab_size is not None:
        kw["vocab_size"] = vocab_size
    positions = max(_DEFAULT_POSITIONS[family], seq or 0)
    if family == "gpt2":
        return GPT2Config(n_positions=positions, **kw)
    if family == "llama":
        return LlamaConfig(max_position_embeddings=positions, **kw)
    return GPTNeoXConfig(max_position_embeddings=positions, **kw)


def build(config: Any) -> Any:
    """A freshly initialised causal LM (on the current default device, which may be `meta`)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)


def default_lr(family: str, size: str) -> float:
    return preset(family, size)[1]
