"""SageMaker model-parallel v1 config dicts are accepted as they are (issue 22, item 1): knobs we
implement behave as in v1, keys that only tuned v1's tracer, pipeline or launcher are accepted with one
warning on rank 0 naming them, and values we cannot honour (or v1 refused) are errors."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

import shardpar as smp
from shardpar.config import Config
from tests.conftest import init_world_of_one

# The shape of AWS's sharded-data-parallel GPT-2 example (train_gpt_simple.py's smp_options).
AWS_GPT2 = {
    "enabled": True,
    "parameters": {
        "ddp": True,
        "skip_tracing": True,
        "delayed_parameter_initialization": True,
        "offload_activations": False,
        "activation_loading_horizon": 4,
        "sharded_data_parallel_degree": 2,
        "sdp_hierarchical_allgather": True,
        "sdp_gradient_clipping": 1.0,
        "fp16": False,
        "bf16": True,
        "partitions": 1,
        "microbatches": 1,
        "placement_strategy": "cluster",
        "optimize": "speed",
        "pipeline": "interleaved",
        "tensor_parallel_degree": 1,
        "prescaled_batch": False,
        "shard_optimizer_state": False,
        "auto_partition": True,
        "default_partition": 0,
        "fast_mode": False,
        "static_mode": False,
        "active_microbatches": 3,
        "memory_weight": 0.8,
        "deterministic_server": False,
        "ddp_port": 29501,
        "predefined_hooks": True,
        "contiguous": True,
        "horovod": False,
    },
}
NO_EFFECT_KEYS = [
    "skip_tracing",
    "placement_strategy",
    "optimize",
    "pipeline",
    "auto_partition",
    "default_partition",
    "fast_mode",
    "static_mode",
    "active_microbatches",
    "memory_weight",
    "deterministic_server",
    "ddp_port",
    "predefined_hooks",
    "contiguous",
    "horovod",
]


def test_an_aws_v1_options_dict_is_accepted_with_its_knobs_applied() -> None:
    cfg = Config.from_dict(AWS_GPT2, env={})
    assert (cfg.sharded_data_parallel_degree, cfg.bf16, cfg.delayed_parameter_initialization) == (2, True, True)
    assert cfg.pipeline_parallel_degree == 1 and cfg.sdp_gradient_clipping == 1.0
    assert (cfg.offload_activations, cfg.activation_loading_horizon) == (False, 4)  # knobs now, not notes
    noted = [note.split("=")[0] for note in cfg.v1_notes]
    assert noted == NO_EFFECT_KEYS  # every one named, in the dict's order, and nothing else
    assert all(": " in note and len(note.split(": ", 1)[1]) > 20 for note in cfg.v1_notes)  # each says why


def test_the_warning_is_given_once_on_rank_0_by_init(monkeypatch: pytest.MonkeyPatch) -> None:
    params = dict(AWS_GPT2["parameters"])  # type: ignore[call-overload]
    params.update(sharded_data_parallel_degree=1, delayed_parameter_initialization=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with init_world_of_one(monkeypatch, **params):
            assert smp.get_config().bf16
    texts = [str(w.message) for w in caught if "SageMaker model-parallel v1" in str(w.message)]
    assert len(texts) == 1, texts
    assert "15 SageMaker model-parallel v1 config key(s)" in texts[0]
    assert all(key in texts[0] for key in NO_EFFECT_KEYS)


def test_a_plain_config_warns_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with init_world_of_one(monkeypatch):
            pass
    assert not [w for w in caught if "v1" in str(w.message)]


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"skip_tracng": True}, r"unknown config key 'skip_tracng'; did you mean 'skip_tracing'\?"),
        ({"pipeline": "fast"}, r"pipeline='fast' must be 'interleaved' or 'simple'"),
        ({"optimize": "size"}, r"optimize='size' must be 'speed' or 'memory'"),
        ({"active_microbatches": 0}, r"active_microbatches=0 must be an integer >= 1"),
        ({"memory_weight": 1.5}, r"memory_weight=1.5 must be a number in \[0, 1\]"),
        ({"skip_tracing": "yes"}, r"skip_tracing='yes' must be true or false"),
        ({"placement_strategy": "DTX"}, r"placement_strategy='DTX' must be 'cluster', 'spread' or a permutation"),
        (
            {"placement_strategy": "spread", "tensor_parallel_degree": 2, "prescaled_batch": True},
            r"placement_strategy='spread' spreads a tensor-parallel group.*set it to 'cluster'",
        ),
        ({"horovod": True}, r"horovod=True: Horovod hybrid parallelism is TensorFlow's"),
        ({"partitions": 2, "sharded_data_parallel_degree": 2}, r"pipeline_parallel_degree"),
        ({"fp16_params": True, "fp16": False}, r"fp16_params=True and fp16=False disagree"),
    ],
)
def test_values_v1_refused_or_we_cannot_honour_are_errors(params: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Config.from_dict(params, env={})


def test_v1_names_of_knobs_mean_the_same() -> None:
    assert Config.from_dict({"fp16_params": True}, env={}).fp16
    assert Config.from_dict({"partitions": 1}, env={}).pipeline_parallel_degree == 1
    cfg = Config.from_dict({"placement_strategy": "spread", "tensor_parallel_degree": 1}, env={})
    assert cfg.v1_notes and "'cluster'" in cfg.v1_notes[0]  # no effect without TP: accepted, said so
    assert Config.from_dict({"placement_strategy": "PDT", "tensor_parallel_degree": 2, "prescaled_batch": True}, env={})
