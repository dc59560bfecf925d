"""`shardpar demo`: the causal-LM recipe (recipes/causal_lm) on N local CPU ranks, started here.

One code path: the demo builds the recipe's `Options` and runs the recipe's `run` on every rank via
`launch_local`, exactly what `torchrun recipes/train_causal_lm.py` runs on each of its ranks.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def recipe(name: str = "train") -> ModuleType:
    """`recipes.causal_lm.<name>`; the recipes live beside the package in a source checkout."""
    try:
        return importlib.import_module(f"recipes.causal_lm.{name}")
    except ModuleNotFoundError as err:
        if err.name not in ("recipes", "recipes.causal_lm") or not (REPO / "recipes" / "causal_lm").is_dir():
            raise RuntimeError(
                "shardpar demo needs the recipes/ directory of a shardpar source checkout "
                f"(looked in {REPO}); install with `pip install -e .` from the repository"
            ) from err
        sys.path.insert(0, str(REPO))
        return importlib.import_module(f"recipes.causal_lm.{name}")


def demo_options(*, sdp: int, steps: int, batch: int, seq: int, out: str) -> Any:
    options = recipe("options")
    return options.Options(
        model="gpt_neox",
        size="tiny",
        sdp=sdp,
        batch=batch,
        seq=seq,
        steps=steps,
        lr=3e-3,
        warmup=max(1, steps // 20),
        out=out,
        checkpoint_every=max(1, steps // 2),
        checkpoint_errors="warn",  # the demo is about training: a failed save is reported, not fatal
        sample_tokens=80,
        prompt="def ",
        smp={"sdp_param_persistence_threshold": 1000},  # shard even the tiny model's small matrices
    )


def demo_rank(opts: Any) -> Any:
    """One rank of the demo (importable: launch_local pickles it by name)."""
    return recipe("train").run(opts)
