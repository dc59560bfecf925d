"""Train a Hugging Face causal LM (GPT-NeoX, Llama, GPT-2) with shardpar.

    # one machine, 4 ranks, the tiny GPT-NeoX on Python's own source, sharded 2 ways:
    torchrun --nproc-per-node 4 recipes/train_causal_lm.py --config recipes/configs/tiny_neox.toml --sdp 2

    # continue from the newest checkpoint after an interruption:
    torchrun --nproc-per-node 4 recipes/train_causal_lm.py --config recipes/configs/tiny_neox.toml --sdp 2 --resume

Without torchrun it runs as a world of one. `--help` lists every option; see docs/user-guide.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `recipes` importable from any directory

from recipes.causal_lm.options import parse_args
from recipes.causal_lm.train import run


def main(argv: list[str] | None = None) -> int:
    try:
        opts = parse_args(argv)
    except ValueError as err:
        print(f"train_causal_lm.py: error: {err}", file=sys.stderr)
        return 2
    result = run(opts)
    if result.rank == 0:
        print(f"metrics: {result.metrics}\nplot:    {result.plot}\nexport:  {result.export}")
        if result.sample is not None:
            print(f"sample:\n{result.sample}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
