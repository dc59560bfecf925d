"""SageMaker model-parallel v1 config keys that have no knob of their own here.

A v1 `smp_options["parameters"]` dict is accepted as it is (issue 22): keys for features shardpar
implements are knobs (config.py); the keys below only tuned v1's tracer, its pipeline engine or its
launcher, so they change nothing here. `split_v1_keys` takes them out of a parameter dict, checks
their values as v1 did, and says why each changes nothing; `smp.init` warns once, on rank 0.
A value that would change results shardpar cannot reproduce is an error, not a warning.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_NO_PIPELINE = "pipeline_parallel_degree is 1 here, so there is no pipeline to tune"
_NO_TRACER = "shardpar does not trace the model: its units come from the module tree"


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _count(minimum: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and int(v) >= minimum


def _one_of(*choices: str) -> Callable[[Any], bool]:
    return lambda v: v in choices


def _fraction(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and 0.0 <= float(v) <= 1.0


@dataclass(frozen=True)
class _Rule:
    ok: Callable[[Any], bool]
    valid: str  # what a valid value is, for the error
    why: str  # why the key changes nothing here, for the warning


NO_EFFECT: dict[str, _Rule] = {
    "skip_tracing": _Rule(_bool, "true or false", _NO_TRACER),
    "predefined_hooks": _Rule(_bool, "true or false", _NO_TRACER),
    "fast_mode": _Rule(_bool, "true or false", _NO_PIPELINE),
    "static_mode": _Rule(_bool, "true or false", _NO_PIPELINE),
    "auto_partition": _Rule(_bool, "true or false", _NO_PIPELINE),
    "default_partition": _Rule(_count(0), "an integer >= 0", _NO_PIPELINE),
    "pipeline": _Rule(_one_of("interleaved", "simple"), "'interleaved' or 'simple'", _NO_PIPELINE),
    "active_microbatches": _Rule(_count(1), "an integer >= 1", _NO_PIPELINE),
    "memory_weight": _Rule(_fraction, "a number in [0, 1]", _NO_PIPELINE + " (it weighted auto-partitioning)"),
    "deterministic_server": _Rule(
        _bool, "true or false", "there is no pipeline execution server: every rank runs its own program in order"
    ),
    "optimize": _Rule(
        _one_of("speed", "memory"),
        "'speed' or 'memory'",
        "it chose how v1's DistributedTransformer split layer norms over TP ranks; shardpar's TP layers keep "
        "layer norms whole, and results do not depend on it",
    ),
    "contiguous": _Rule(_bool, "true or false", "a TensorFlow partitioning option; shardpar is PyTorch"),
    "ddp_port": _Rule(_count(1), "a port number", "the launcher (torchrun's MASTER_PORT) chooses the port"),
}

# v1 names of shardpar knobs (the values mean the same).
ALIASES = {"partitions": "pipeline_parallel_degree", "fp16_params": "fp16"}


def _placement_keeps_tp_adjacent(strategy: str) -> bool:
    """v1's placement_strategy: 'cluster' = 'DPT', 'spread' = 'TPD'; the right-most letter varies
    fastest over the ranks. shardpar's layout puts TP ranks next to each other: T right-most."""
    letters = {"cluster": "DPT", "spread": "TPD"}.get(strategy, strategy)
    return letters.endswith("T")


def _check_placement(value: Any, tensor_parallel_degree: int) -> str:
    valid = isinstance(value, str) and (
        value in ("cluster", "spread") or (len(value) == 3 and sorted(value) == ["D", "P", "T"])
    )
    if not valid:
        raise ValueError(
            f"placement_strategy={value!r} must be 'cluster', 'spread' or a permutation of 'DPT' (as in SageMaker "
            "model parallel v1); shardpar's layout is 'cluster'"
        )
    if tensor_parallel_degree > 1 and not _placement_keeps_tp_adjacent(value):
        raise ValueError(
            f"placement_strategy={value!r} spreads a tensor-parallel group over distant ranks, but shardpar always "
            f"places the {tensor_parallel_degree} ranks of a TP group next to each other (v1's 'cluster', 'DPT'); "
            "remove the key or set it to 'cluster'"
        )
    return "shardpar's rank layout (TP groups of adjacent ranks, then sharding groups) is v1's 'cluster'"


def split_v1_keys(params: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """(the parameters without the no-effect v1 keys, one note per such key). Raises ValueError for a
    value v1 would have refused, or one whose meaning shardpar cannot reproduce."""
    rest: dict[str, Any] = {}
    notes: list[str] = []
    for key, value in params.items():
        if key == "placement_strategy":
            notes.append(f"placement_strategy={value!r}: " + _check_placement(value, _tp_of(params)))
        elif key == "horovod":
            if value is not False:
                raise ValueError(
                    f"horovod={value!r}: Horovod hybrid parallelism is TensorFlow's; shardpar runs on "
                    "torch.distributed. Remove the key (or set it to false)"
                )
            notes.append("horovod=False: " + "shardpar runs on torch.distributed")
        elif key in NO_EFFECT:
            rule = NO_EFFECT[key]
            if not rule.ok(value):
                raise ValueError(f"{key}={value!r} must be {rule.valid} (as in SageMaker model parallel v1)")
            notes.append(f"{key}={value!r}: {rule.why}")
        else:
            rest[key] = value
    return rest, tuple(notes)


def _tp_of(params: Mapping[str, Any]) -> int:
    tp = params.get("tensor_parallel_degree", 1)
    return tp if isinstance(tp, int) and not isinstance(tp, bool) else 1


def warning_text(notes: tuple[str, ...]) -> str:
    return f"{len(notes)} SageMaker model-parallel v1 config key(s) accepted but changing nothing here: " + "; ".join(
        notes
    )
