"""Bad input to the Hugging Face front ends is refused before shardpar does any work (no smp.init, no
process group): each TrainingArguments choice shardpar cannot honour is named with its fix, and the
shardpar config is reconciled with the arguments that also speak about it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from transformers import TrainingArguments

import shardpar as smp
from shardpar.integrations.accelerate import Accelerator
from shardpar.integrations.transformers import Trainer, UnsupportedArguments
from tests.multiproc.trainer_cases import fresh_accelerate_state


@pytest.fixture(autouse=True)
def one_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    yield
    assert not smp.is_initialized(), "a refused construction must not have initialised shardpar"


def _args(tmp_path: Any, **changes: Any) -> TrainingArguments:
    fresh_accelerate_state()
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **changes)


@pytest.mark.parametrize(
    ("changes", "named", "fix"),
    [
        ({"fsdp": True}, "fsdp=True", "sharded_data_parallel_degree"),
        ({"torch_compile": True}, "torch_compile=True", "set torch_compile=False"),
        ({"optim": "lion_8bit"}, "optim='lion_8bit'", "sgd, adagrad, rmsprop, adafactor"),
        ({"bf16_full_eval": True}, "bf16_full_eval=True", "drop the flag"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size=True", "set the batch size"),
    ],
)
def test_unsupported_training_arguments_are_named_with_their_fix(
    tmp_path: Any, changes: dict[str, Any], named: str, fix: str
) -> None:
    with pytest.raises(UnsupportedArguments) as info:
        Trainer(model=None, args=_args(tmp_path, **changes))
    assert named in str(info.value) and fix in str(info.value), str(info.value)


def test_every_problem_is_listed_at_once_and_model_init_is_refused(tmp_path: Any) -> None:
    args = _args(tmp_path, torch_compile=True, optim="galore_adamw")
    with pytest.raises(UnsupportedArguments) as info:
        Trainer(args=args, model_init=lambda: None)
    text = str(info.value)
    assert "torch_compile=True" in text and "optim='galore_adamw'" in text and "model_init=" in text, text


def test_a_launcher_world_that_transformers_does_not_see_asks_for_use_cpu(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = _args(tmp_path)  # one process: transformers sees world 1
    monkeypatch.setenv("WORLD_SIZE", "4")  # what torchrun would have set
    with pytest.raises(UnsupportedArguments, match=r"see 1 process\(es\) but the launcher started 4.*use_cpu=True"):
        Trainer(model=None, args=args)


@pytest.mark.parametrize(
    ("changes", "config", "message"),
    [
        ({}, {"bf16": True}, "precision 'no' .* the shardpar config has 'bf16'"),
        ({"fp16": True}, {"bf16": True}, "precision 'fp16' .* has 'bf16'"),
        ({"max_grad_norm": 0.3}, {"sdp_gradient_clipping": 0.7}, r"sdp_gradient_clipping=0.7 .*max_grad_norm=0.3"),
        ({}, {"microbatches": 2}, "gradient_accumulation_steps"),
        ({}, {"sharded_data_parallel_degre": 2}, "sharded_data_parallel_degre"),  # a typo'd knob
    ],
)
def test_shardpar_config_that_contradicts_the_arguments_is_refused(
    tmp_path: Any, changes: dict[str, Any], config: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Trainer(model=None, args=_args(tmp_path, **changes), shardpar_config=config)


def test_accelerator_refuses_a_bad_config_before_accelerate_starts() -> None:
    fresh_accelerate_state()
    with pytest.raises(ValueError, match="sdp_gradient_clippin"):
        Accelerator(cpu=True, shardpar_config={"sdp_gradient_clippin": 1.0})
    from accelerate.state import PartialState

    assert not PartialState._shared_state, "accelerate's state was set up before the config was checked"


def test_full_export_under_a_large_max_shard_size_is_one_model_safetensors() -> None:
    """accelerate's save_model passes max_shard_size="10GB": a model under it is one file named as
    save_pretrained names it (a lone "model-00001-of-00001.safetensors" without an index is a
    directory from_pretrained cannot load)."""
    from types import SimpleNamespace

    from shardpar.checkpoint.full import split_files

    def item(unit: int) -> Any:
        return SimpleNamespace(source="unit", unit=unit, entry=SimpleNamespace(nbytes=400))

    items = [item(0), item(0), item(1)]
    assert [name for name, _ in split_files(items, 10**10)] == ["model.safetensors"]
    assert [name for name, _ in split_files(items, None)] == ["model.safetensors"]
    names = [name for name, _ in split_files(items, 1000)]
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
