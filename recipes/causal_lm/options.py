"""Every option of the causal-LM recipe: defaults < config file (JSON/TOML) < command-line flags.

    python recipes/train_causal_lm.py --config recipes/configs/tiny_neox.toml --sdp 2 --steps 50

A config file holds the same names as the flags (dashes or underscores) plus an optional `smp`
table of extra shardpar knobs; `--smp KEY=VALUE` adds or overrides one knob.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FAMILIES = ("gpt_neox", "llama", "gpt2")
PRECISIONS = ("fp32", "bf16", "fp16")
TOKENIZERS = ("byte", "bpe")
PROGRESS = ("auto", "bar", "lines", "none")


@dataclass(frozen=True)
class Options:
    model: str = "gpt_neox"
    size: str = "tiny"
    sdp: int = 1
    tp: int = 1
    precision: str = "fp32"
    batch: int = 4  # sequences per data-parallel rank (per tensor-parallel group) per micro-step
    seq: int = 128
    steps: int = 100
    accum: int = 1  # micro-steps per optimizer step (backward_passes_per_step)
    lr: float | None = None  # None: the size's default
    warmup: int | None = None  # None: min(100, steps // 10)
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    data: tuple[str, ...] = ()  # text files or directories; empty: Python's stdlib source
    tokenizer: str = "byte"
    vocab_size: int = 2048  # bpe only
    out: str = "runs/causal_lm"
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None  # None: <out>/checkpoints
    keep_checkpoints: int = 2
    resume: str | None = None  # "newest" or a tag
    export: bool = True
    checkpoint_errors: str = "raise"  # "warn": a failed save/export is reported and training goes on
    async_checkpoints: bool = False  # save returns after a host copy; a background thread writes (docs/checkpoints.md)
    preemption: bool = True  # on SIGTERM every rank saves at the step's end and exits 143 (--resume continues)
    snapshot_every: int = 0  # every N steps each rank copies its state to host shared memory (/dev/shm)
    auto_resume: bool = True  # a restarted run (torchrun restart, snapshots a crash left) resumes by itself
    sample_tokens: int = 64
    prompt: str = "def "
    log_every: int = 0  # 0: about 20 lines per run when stdout is not a terminal
    progress: str = "auto"
    activation_checkpointing: bool = False
    activation_offloading: bool = False  # implies checkpointing; host memory for the kept layer inputs (GPU)
    delayed_init: bool = False
    smp: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_choice("model", self.model, FAMILIES)
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("tokenizer", self.tokenizer, TOKENIZERS)
        _check_choice("progress", self.progress, PROGRESS)
        _check_choice("checkpoint_errors", self.checkpoint_errors, ("raise", "warn"))
        for name in ("sdp", "tp", "batch", "seq", "steps", "accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name}={getattr(self, name)} must be >= 1")
        if self.snapshot_every < 0:
            raise ValueError(f"--snapshot-every={self.snapshot_every} must be >= 0 (0: no in-memory snapshots)")
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every={self.checkpoint_every} must be >= 0 (0: no checkpoints)")
        if self.tokenizer == "bpe" and self.vocab_size <= 257:
            raise ValueError(f"--vocab-size={self.vocab_size} must exceed 257 (256 bytes + end-of-text) for bpe")

    @property
    def checkpoint_path(self) -> Path:
        return Path(self.checkpoint_dir) if self.checkpoint_dir else Path(self.out) / "checkpoints"

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else min(100, self.steps // 10)

    def replace(self, **changes: Any) -> Options:
        return dataclasses.replace(self, **changes)

    def shardpar_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "sharded_data_parallel_degree": self.sdp,
            "tensor_parallel_degree": self.tp,
            "sdp_gradient_clipping": self.clip,
            "bf16": self.precision == "bf16",
            "fp16": self.precision == "fp16",
        }
        if self.tp > 1:
            cfg["prescaled_batch"] = True  # reference 003: the TP group reads one combined batch
        if self.delayed_init:
            cfg["delayed_parameter_initialization"] = True
        if self.snapshot_every:
            cfg["checkpoint_snapshot_interval"] = self.snapshot_every
        return {**cfg, **self.smp}


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"--{name.replace('_', '-')}={value!r} is not one of {', '.join(choices)}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train_causal_lm.py",
        description="Train a Hugging Face causal LM with shardpar (launch with torchrun for several ranks).",
        argument_default=argparse.SUPPRESS,  # only flags the user gave override the config file
    )
    p.add_argument("--config", help="JSON or TOML file with any of these options")
    p.add_argument("--model", choices=FAMILIES, help="model family (default gpt_neox)")
    p.add_argument("--size", help="named size, e.g. tiny, 160m, 20b, 65b (see models.py)")
    p.add_argument("--sdp", type=int, help="sharded_data_parallel_degree")
    p.add_argument("--tp", type=int, help="tensor_parallel_degree")
    prec = p.add_mutually_exclusive_group()
    prec.add_argument("--bf16", dest="precision", action="store_const", const="bf16")
    prec.add_argument("--fp16", dest="precision", action="store_const", const="fp16")
    prec.add_argument("--fp32", dest="precision", action="store_const", const="fp32")
    p.add_argument("--batch", type=int, help="sequences per data-parallel rank per micro-step")
    p.add_argument("--seq", type=int, help="sequence length in tokens")
    p.add_argument("--steps", type=int, help="optimizer steps in total (a resumed run continues to this)")
    p.add_argument("--accum", type=int, help="gradient-accumulation micro-steps per optimizer step")
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup", type=int, help="linear warm-up steps before the cosine decay")
    p.add_argument("--weight-decay", type=float)
    p.add_argument("--clip", type=float, help="sdp_gradient_clipping (global L2 norm; 0 disables)")
    p.add_argument("--seed", type=int)
    p.add_argument("--data", nargs="+", help="text files or directories (default: Python's stdlib source)")
    p.add_argument("--tokenizer", choices=TOKENIZERS, help="byte (256 + end-of-text) or a BPE trained here")
    p.add_argument("--vocab-size", type=int, help="BPE vocabulary size")
    p.add_argument("--out", help="run directory: metrics.jsonl, loss.png, checkpoints/, export/")
    p.add_argument("--checkpoint-every", type=int, help="save a resumable checkpoint every N steps (0: never)")
    p.add_argument("--checkpoint-dir", help="default <out>/checkpoints")
    p.add_argument("--keep-checkpoints", type=int, help="newest partial checkpoints to keep")
    p.add_argument("--resume", nargs="?", const="newest", help="resume from the newest checkpoint, or from TAG")
    p.add_argument(
        "--checkpoint-errors", choices=("raise", "warn"), help="warn: report a failed save/export and keep training"
    )
    p.add_argument(
        "--async-checkpoints", action="store_true", help="write checkpoints in the background (training goes on)"
    )
    p.add_argument(
        "--no-preemption", dest="preemption", action="store_false", help="SIGTERM kills at once (no save first)"
    )
    p.add_argument("--snapshot-every", type=int, help="copy each rank's state to /dev/shm every N steps (0: never)")
    p.add_argument(
        "--no-auto-resume", dest="auto_resume", action="store_false",
        help="a restarted run starts from step 0 instead of the newest snapshot or checkpoint",
    )  # fmt: skip
    p.add_argument("--no-export", dest="export", action="store_false", help="skip the Hugging Face export")
    p.add_argument("--sample-tokens", type=int, help="tokens generated at the end (0: none)")
    p.add_argument("--prompt")
    p.add_argument("--log-every", type=int, help="progress line every N steps (0: automatic)")
    p.add_argument("--progress", choices=PROGRESS)
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each layer in backward")
    p.add_argument(
        "--activation-offloading", action="store_true", help="checkpointing, with kept inputs in host memory (GPU)"
    )
    p.add_argument("--delayed-init", action="store_true", help="each rank materialises only its shards")
    p.add_argument(
        "--smp", action="append", metavar="KNOB=VALUE", help="any shardpar knob, e.g. sdp_max_live_parameters=1e8"
    )
    return p


def parse_args(argv: list[str] | None = None) -> Options:
    given = vars(build_parser().parse_args(argv))
    raw = read_config(Path(given.pop("config"))) if "config" in given else {}
    knobs = dict(raw.pop("smp", {}))
    for item in given.pop("smp", []):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--smp {item!r} must look like KNOB=VALUE")
        knobs[key.strip()] = _parse_value(value.strip())
    merged = {**raw, **given, "smp": knobs}
    if "data" in merged:
        merged["data"] = tuple(merged["data"]) if not isinstance(merged["data"], str) else (merged["data"],)
    return Options(**merged)


def read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"--config {path}: no such file")
    text = path.read_text()
    raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    out = {k.replace("-", "_"): v for k, v in raw.items()}
    names = {f.name for f in dataclasses.fields(Options)}
    unknown = sorted(set(out) - names)
    if unknown:
        raise ValueError(f"--config {path}: unknown option(s) {unknown}; known: {sorted(names)}")
    return out


def _parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            continue
        return int(value) if kind is float and value == int(value) and "e" in lowered else value
    return text
