"""Text, tokenizer and batches.

The default corpus is the source of a fixed list of Python standard-library modules: present on every
install, so nothing is downloaded. Both tokenizers are `tokenizers` objects, so the Hugging Face export
carries a `tokenizer.json` that `AutoTokenizer.from_pretrained` loads:

* byte: the 256 bytes (id = byte value) plus <|endoftext|> (256) -- a byte-level BPE with no merges;
* bpe:  a byte-level BPE trained here on the corpus (rank 0 trains and saves it, the others load it).

Batches are a pure function of (seed, step, micro-step, data-parallel rank): a resumed run reads
exactly the batches the uninterrupted run would have read, with no sampler state to checkpoint.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

EOT = "<|endoftext|>"
STDLIB_MODULES = (
    "argparse", "ast", "bisect", "calendar", "collections", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "difflib", "enum", "fractions", "functools", "heapq", "inspect", "json.decoder",
    "json.encoder", "logging", "pathlib", "pprint", "random", "shlex", "statistics", "string", "textwrap",
    "tokenize", "typing",
)  # fmt: skip
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".csv", ".html", ".tex"}


def stdlib_texts() -> list[str]:
    texts = []
    for name in STDLIB_MODULES:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if origin and origin.endswith(".py") and Path(origin).is_file():
            texts.append(Path(origin).read_text(encoding="utf-8"))
    if not texts:
        raise ValueError("no Python standard-library source found for the default corpus; pass --data FILES")
    return texts


def read_texts(paths: tuple[str, ...]) -> list[str]:
    """Every file given, and every text file (by suffix) under every directory given, in sorted order."""
    files: list[Path] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"--data {raw}: no such file or directory")
    if not files:
        raise ValueError(f"--data {' '.join(paths)}: no text files found (suffixes {sorted(TEXT_SUFFIXES)})")
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab[EOT] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return tok


def train_bpe(texts: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(
    kind: str, texts: list[str], vocab_size: int, cache: Path, *, is_first: bool, wait: Callable[[], None]
) -> Any:
    """byte: built on every rank; bpe: trained by rank 0 into `cache`, then loaded by every rank."""
    if kind == "byte":
        return byte_tokenizer()
    from tokenizers import Tokenizer

    if is_first:
        cache.parent.mkdir(parents=True, exist_ok=True)
        train_bpe(texts, vocab_size).save(str(cache))
    wait()
    return Tokenizer.from_file(str(cache))


def encode(tokenizer: Any, texts: list[str]) -> torch.Tensor:
    """All texts as one token stream, documents separated by <|endoftext|>."""
    eot = tokenizer.token_to_id(EOT)
    if tokenizer.get_vocab_size() == 257 and eot == 256:
        # the byte tokenizer: ids are the UTF-8 bytes (what encode_batch gives, without its threads,
        # which N ranks on a few cores would fight over)
        raw = b"".join(t.encode("utf-8") + b"\x00" for t in texts)
        stream = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        ends = torch.cumsum(torch.tensor([len(t.encode("utf-8")) + 1 for t in texts]), 0) - 1
        stream[ends] = eot
        return stream
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids += enc.ids
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def batch(
    tokens: torch.Tensor, *, seed: int, step: int, micro: int, rank: int, size: int, seq: int
) -> dict[str, torch.Tensor]:
    """`size` random windows of `seq` tokens: a pure function of its arguments."""
    if tokens.numel() <= seq + 1:
        raise ValueError(f"the corpus has {tokens.numel()} tokens, fewer than --seq {seq} + 1; use more text")
    g = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1009 + micro) * 65_537 + rank)
    starts = torch.randint(0, tokens.numel() - seq, (size,), generator=g)
    ids = torch.stack([tokens[s : s + seq] for s in starts.tolist()])
    return {"input_ids": ids, "labels": ids.clone()}


def model_vocab(tokenizer: Any) -> int:
    """The embedding rows: the tokenizer's size rounded up to a multiple of 64 (friendlier GEMMs)."""
    n = int(tokenizer.get_vocab_size())
    return -(-n // 64) * 64
