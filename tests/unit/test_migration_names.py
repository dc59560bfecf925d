"""docs/migration.md's "Every SMP v1 name" tables stay honest: every name they call same or different
exists under `import shardpar as smp` (and every one they call not provided does not), every config key
they list is accepted by `smp.init`, they list every name of SMP v1's API documentation, and the v1
recipe uses only names they list."""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpar as smp
from shardpar.config import Config
from tests import models

ROOT = Path(__file__).resolve().parents[2]
STATUSES = ("same", "different", "not provided")

# Every name of SMP v1's PyTorch API documentation (common API, PyTorch API, tensor-parallel API) and
# every `smp.` name of AWS's published v1 example scripts -- with the DeepSpeed attributes their
# sharded-data-parallel templates read (sdp_utils.py: `param.` is a parameter of model.parameters()):
# the tables must list each.
V1_DOCUMENTED = re.findall(
    r"\S+",
    """
smp.init smp.step smp.StepOutput StepOutput.outputs StepOutput.reduce_mean StepOutput.reduce_sum StepOutput.concat
StepOutput.stack smp.rank smp.size smp.local_rank smp.local_size smp.get_world_process_group smp.get_mp_group
smp.get_dp_group smp.tp_rank smp.tp_size smp.get_tp_process_group smp.pp_rank smp.pp_size smp.get_pp_process_group
smp.rdp_rank smp.rdp_size smp.get_rdp_process_group smp.mp_rank smp.mp_size smp.get_mp_process_group smp.dp_rank
smp.dp_size smp.get_dp_process_group smp.CommGroup smp.WORLD smp.MP_GROUP smp.DP_GROUP smp.TP_GROUP smp.PP_GROUP
smp.RDP_GROUP smp.RankType smp.RankType.WORLD_RANK smp.RankType.MP_RANK smp.RankType.DP_RANK smp.RankType.PP_RANK
smp.RankType.TP_RANK smp.RankType.RDP_RANK smp.broadcast smp.send smp.recv_from smp.allgather smp.barrier
smp.dp_barrier smp.mp_barrier smp.DistributedModel model.partitioned model.backward model.local_buffers
model.local_named_buffers model.local_parameters model.local_named_parameters model.local_modules
model.local_named_modules model.local_state_dict model.state_dict model.load_state_dict
model.register_post_partition_hook model.cpu model.join model.register_comm_hook model.distributed_modules
model.is_distributed_parameter model.is_distributed_buffer model.is_scaled_batch_parameter
model.is_scaled_batch_buffer model.default_reducer_named_parameters model.scaled_batch_reducer_named_parameters
model.get_module smp.DistributedOptimizer optimizer.state_dict optimizer.load_state_dict optimizer.local_state_dict
optimizer.clip_master_grads optimizer.overflow optimizer.fp16_groups optimizer.loss_scaler
optimizer.fp32_from_fp16_groups smp.nn.FlashAttentionLayer smp.model_creation smp.partition smp.amp.GradScaler
smp.delay_param_initialization smp.is_initialized smp.is_tracing smp.nn.FusedLayerNorm smp.optimizers.FusedNovoGrad
smp.optimizers.FusedLamb smp.save smp.load smp.save_checkpoint smp.resume_from_checkpoint smp.tp_register
smp.tp_register_with_module smp.nn.DistributedLinear smp.nn.DistributedTransformerLMHead smp.nn.DistributedTransformer
smp.nn.DistributedTransformerLayer smp.nn.DistributedAttentionLayer smp.nn.DistributedTransformerOutputLayer
smp.nn.DistributedEmbedding smp.tensor_parallelism smp.set_tensor_parallelism smp.patches.checkpoint.checkpoint
smp.patches.checkpoint.checkpoint_sequential smp.set_activation_checkpointing smp.set_partition smp.state.cfg
smp.register_parameter smp.hvd_average_grads
smp.nn.huggingface.gpt2.translate_state_dict_to_hf_gpt2
smp.nn.huggingface.gpt2.translate_hf_state_dict_to_smdistributed_gpt2
smp.nn.huggingface.bert.translate_state_dict_to_hf_bert
smp.nn.huggingface.bert.translate_hf_state_dict_to_smdistributed_bert
smp.nn.huggingface.roberta.translate_state_dict_to_hf_roberta
smp.nn.huggingface.roberta.translate_hf_state_dict_to_smdistributed_roberta
smp.nn.huggingface.gptj.translate_state_dict_to_hf_gptj
smp.nn.huggingface.gptj.translate_hf_state_dict_to_smdistributed_gptj
smp.nn.huggingface.gptneo.translate_state_dict_to_hf_gptneo
smp.nn.huggingface.gptneo.translate_hf_state_dict_to_smdistributed_gptneo
smp.model.DistributedModel StepOutput.map model.register_post_step_hook param.ds_tensor param.ds_param_shard_group
optimizer._global_grad_norm optimizer.ds_param_shard_group optimizer.fp32_partitioned_groups_flat
""",
)

# v1's `modelparallel` parameters with a valid v1 value each (the defaults where v1 had one).
V1_CONFIG = {
    "partitions": 1, "pipeline_parallel_degree": 1, "microbatches": 1, "pipeline": "interleaved",
    "optimize": "speed", "placement_strategy": "cluster", "auto_partition": True, "default_partition": 0,
    "tensor_parallel_degree": 1, "fp16_params": False, "shard_optimizer_state": False, "prescaled_batch": False,
    "skip_tracing": False, "contiguous": True, "horovod": False, "memory_weight": 0.8, "ddp": True,
    "active_microbatches": 3, "deterministic_server": False, "offload_activations": False,
    "activation_loading_horizon": 4, "sharded_data_parallel_degree": 1, "sdp_reduce_bucket_size": int(5e8),
    "sdp_param_persistence_threshold": int(1e6), "sdp_max_live_parameters": int(1e9),
    "sdp_hierarchical_allgather": True, "sdp_gradient_clipping": 1.0, "fp16": False, "bf16": False,
    "ddp_dist_backend": "auto", "delayed_parameter_initialization": False, "predefined_hooks": True,
    "fast_mode": False, "static_mode": False, "ddp_port": 29501,
}  # fmt: skip


def _tables() -> Iterator[tuple[str, list[str], str]]:
    """(table caption, names, status) for every row of the section."""
    text = (ROOT / "docs" / "migration.md").read_text()
    section = text[text.index("**Every SMP v1 name.**") : text.index("**Different.**")]
    caption = ""
    for line in section.splitlines():
        found = re.match(r"\*`?(\w+)", line)
        if found and not line.startswith("**"):
            caption = found.group(1)
        elif line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            yield caption, re.findall(r"`([^`]+)`", cells[0]), cells[1]


ROWS = list(_tables())
NAMES = {name: (caption, status) for caption, names, status in ROWS for name in names}


def test_the_tables_parse_and_each_row_has_a_status() -> None:
    captions = {caption for caption, _, _ in ROWS}
    assert captions == {"Configuration", "Functions", "DistributedModel", "DistributedOptimizer", "smp"}
    assert all(status in STATUSES for _, _, status in ROWS), [r for r in ROWS if r[2] not in STATUSES]
    assert len(NAMES) == sum(len(names) for _, names, _ in ROWS), "a name listed twice"


def test_every_documented_v1_name_is_listed() -> None:
    missing = [n for n in V1_DOCUMENTED if n not in NAMES]
    assert not missing, missing
    config = {n for n, (caption, _) in NAMES.items() if caption == "Configuration"}
    assert config == set(V1_CONFIG)


def test_every_v1_config_key_is_accepted() -> None:
    for key, value in V1_CONFIG.items():
        Config.from_dict({key: value}, env={})  # raises for an unknown key or a refused value


def _resolve(path: str) -> Any:
    """The object `path` (smp.a.b.c) names under shardpar, importing submodules on the way."""
    parts = path.split(".")[1:]
    obj: Any = smp
    for i, part in enumerate(parts):
        if not hasattr(obj, part):
            module = "shardpar." + ".".join(parts[: i + 1])
            try:
                obj = importlib.import_module(module)
                continue
            except ImportError:
                raise AttributeError(path) from None
        obj = getattr(obj, part)
    return obj


@pytest.fixture(scope="module")
def instances(monkeypatch_module: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    from tests.conftest import init_world_of_one

    with init_world_of_one(monkeypatch_module):
        model = smp.DistributedModel(models.tiny_neox())
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        yield {
            "model": model,
            "optimizer": optimizer,
            "StepOutput": smp.StepOutput([torch.zeros(1)]),
            "param": next(iter(model.parameters())),
        }


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _exists(name: str, instances: dict[str, Any]) -> bool:
    head, _, attr = name.partition(".")
    if head == "smp":
        try:
            _resolve(name)
        except AttributeError:
            return False
        return True
    return hasattr(instances[head], attr)


def test_every_name_called_same_or_different_exists_and_no_other(instances: dict[str, Any]) -> None:
    wrong = []
    for name, (caption, status) in NAMES.items():
        if caption == "Configuration":
            continue
        if _exists(name, instances) != (status != "not provided"):
            wrong.append(f"{name}: listed {status!r}")
    assert not wrong, wrong


# What the v1 recipe may use on model and optimizer besides the table's names: plain torch.
_TORCH_SURFACE = {"train", "eval", "parameters", "named_parameters", "zero_grad", "step", "param_groups"}


def test_the_v1_recipe_uses_only_listed_names() -> None:
    """memory_tracker.py is left out: it stands in for AWS's helper of that name, which read torch.cuda
    and psutil, and reads shardpar's own smp.memory_metrics() instead."""
    files = [p for p in sorted((ROOT / "recipes" / "smp_v1").glob("*.py")) if p.name != "memory_tracker.py"]
    assert len(files) == 6
    source = "\n".join(p.read_text() for p in files)
    used = set(re.findall(r"\bsmp\.[A-Za-z_][\w.]*[A-Za-z_0-9]", source))
    used |= {f"{obj}.{attr}" for obj, attr in re.findall(r"\b(model|optimizer)\.([a-z_]\w*)", source)}
    unlisted = sorted(
        n
        for n in used
        if n not in NAMES and n.split(".", 1)[1] not in _TORCH_SURFACE and not n.startswith("smp.RankType.")
    )
    assert not unlisted, unlisted
    assert all(NAMES[n][1] != "not provided" for n in used if n in NAMES)
