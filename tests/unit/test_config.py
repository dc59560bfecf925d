"""Config: every knob, every source, every bad input with a message that names knob, value, rule, fix."""

from __future__ import annotations

import json

import pytest

from shardpar.config import Config, describe_knobs

REFERENCE_DEFAULTS = {
    "sharded_data_parallel_degree": 1,
    "tensor_parallel_degree": 1,
    "pipeline_parallel_degree": 1,
    "shard_optimizer_state": False,
    "sdp_reduce_bucket_size": 500_000_000,
    "sdp_param_persistence_threshold": 1_000_000,
    "sdp_max_live_parameters": 1_000_000_000,
    "sdp_hierarchical_allgather": True,
    "sdp_gradient_clipping": 1.0,
    "fp16": False,
    "bf16": False,
    "ddp_dist_backend": "auto",
    "prescaled_batch": False,
    "delayed_parameter_initialization": False,
    "microbatches": 1,
    "smddp_ag_scratch_buffer_size_bytes": 16 * 1024 * 1024,
    "smddp_ag_sort_buffer_size_bytes": 128 * 1024 * 1024,
}


def test_defaults_match_the_reference() -> None:
    cfg = Config.from_dict({}, env={})
    for name, value in REFERENCE_DEFAULTS.items():
        assert getattr(cfg, name) == value, name
    assert {n for n, _, _ in describe_knobs()} >= set(REFERENCE_DEFAULTS)


def test_sagemaker_form_with_reference_example_is_accepted() -> None:
    # The smp_options of reference 003, pasted unchanged (5e8 etc. are floats there).
    smp_options = {
        "enabled": True,
        "parameters": {
            "ddp": True,
            "partitions": 1,
            "sharded_data_parallel_degree": 2,
            "sdp_reduce_bucket_size": 5e8,
            "sdp_param_persistence_threshold": 1e6,
            "sdp_max_live_parameters": 1e9,
            "sdp_hierarchical_allgather": True,
            "sdp_gradient_clipping": 1.0,
            "bf16": True,
            "ddp_dist_backend": "auto",
        },
    }
    cfg = Config.from_any(smp_options)
    assert cfg.sharded_data_parallel_degree == 2 and cfg.bf16
    assert cfg.sdp_reduce_bucket_size == 500_000_000 and isinstance(cfg.sdp_reduce_bucket_size, int)


def test_json_and_toml_files(tmp_path) -> None:
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"sharded_data_parallel_degree": 4, "fp16": True}))
    t = tmp_path / "c.toml"
    t.write_text("sharded_data_parallel_degree = 4\nsdp_gradient_clipping = 0.5\n")
    assert Config.from_any(str(j)).fp16
    assert Config.from_any(t).sdp_gradient_clipping == 0.5
    with pytest.raises(ValueError, match=r"does not exist"):
        Config.from_any(str(tmp_path / "missing.json"))
    bad = tmp_path / "c.yaml"
    bad.write_text("x: 1")
    with pytest.raises(ValueError, match=r"unknown extension '\.yaml'; use \.json or \.toml"):
        Config.from_any(bad)


def test_environment_sources(tmp_path) -> None:
    env = {
        "SM_HP_MP_PARAMETERS": json.dumps({"sharded_data_parallel_degree": 2, "ddp": True}),
        "SHARDPAR_BF16": "true",
        "SHARDPAR_SDP_MAX_LIVE_PARAMETERS": "1000",
        "SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES": "8192",
    }
    cfg = Config.from_env(env)
    assert cfg.sharded_data_parallel_degree == 2 and cfg.bf16 and cfg.sdp_max_live_parameters == 1000
    assert cfg.smddp_ag_scratch_buffer_size_bytes == 8192
    path = tmp_path / "c.json"
    path.write_text('{"microbatches": 4}')
    assert Config.from_env({"SHARDPAR_CONFIG": str(path)}).microbatches == 4
    assert Config.from_env({"SHARDPAR_CONFIG": '{"microbatches": 2}'}).microbatches == 2
    with pytest.raises(ValueError, match=r"SHARDPAR_SDP_MAX_LIVE_PARAMS.*did you mean 'sdp_max_live_parameters'"):
        Config.from_env({"SHARDPAR_SDP_MAX_LIVE_PARAMS": "3"})


def test_unknown_key_suggests_the_right_one() -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown config key 'sharded_data_paralel_degree'; did you mean "
        r"'sharded_data_parallel_degree'\?",
    ):
        Config.from_dict({"sharded_data_paralel_degree": 2}, env={})
    with pytest.raises(ValueError, match=r"unknown config key 'zzz'; known knobs: .*bf16"):
        Config.from_dict({"zzz": 1}, env={})


@pytest.mark.parametrize(
    ("knobs", "world", "pattern"),
    [
        (
            {"sharded_data_parallel_degree": 3},
            8,
            r"sharded_data_parallel_degree=3 must divide the reduced data-parallel degree 8 \(world 8 / "
            r"tensor_parallel_degree 1\); try one of 1, 2, 4, 8",
        ),
        (
            {"sharded_data_parallel_degree": 4, "tensor_parallel_degree": 2, "prescaled_batch": True},
            4,
            r"sharded_data_parallel_degree=4 must divide the reduced data-parallel degree 2 \(world 4 / "
            r"tensor_parallel_degree 2\); try one of 1, 2",
        ),
        (
            {"tensor_parallel_degree": 3, "prescaled_batch": True},
            8,
            r"tensor_parallel_degree=3 must divide the world size 8; try one of 1, 2, 4, 8",
        ),
        ({"ranks_per_node": 3}, 8, r"ranks_per_node=3 must divide the world size 8"),
    ],
)
def test_world_rules(knobs: dict, world: int, pattern: str) -> None:
    cfg = Config.from_dict(knobs, env={})
    with pytest.raises(ValueError, match=pattern):
        cfg.check_world(world)


@pytest.mark.parametrize(
    ("knobs", "pattern"),
    [
        (
            {"sharded_data_parallel_degree": 2, "pipeline_parallel_degree": 2},
            r"pipeline_parallel_degree=2: shardpar has no pipeline parallelism .* set pipeline_parallel_degree=1",
        ),
        (
            {"sharded_data_parallel_degree": 2, "partitions": 2},
            r"pipeline_parallel_degree=2: shardpar has no pipeline parallelism",
        ),
        # sdp 1 too: there is no pipeline, so it would be ignored
        ({"pipeline_parallel_degree": 2}, r"pipeline_parallel_degree=2: shardpar has no pipeline parallelism"),
        (
            {"partitions": 2, "pipeline_parallel_degree": 1},
            r"partitions=2 and pipeline_parallel_degree=1 disagree \(partitions is the SageMaker v1 name",
        ),
        ({"fp16": True, "bf16": True}, r"fp16=True and bf16=True were both set; choose one"),
        (
            {"sdp_param_persistence_threshold": -1},
            r"sdp_param_persistence_threshold=-1 must be >= 0; the default is 1000000",
        ),
        ({"sdp_reduce_bucket_size": -5}, r"sdp_reduce_bucket_size=-5 must be > 0; the default is 500000000"),
        ({"sdp_reduce_bucket_size": 0}, r"sdp_reduce_bucket_size=0 must be > 0"),
        ({"sdp_max_live_parameters": 0}, r"sdp_max_live_parameters=0 must be > 0"),
        ({"sdp_gradient_clipping": -1.0}, r"sdp_gradient_clipping=-1.0 must be >= 0"),
        (
            {"sharded_data_parallel_degree": "2"},
            r"sharded_data_parallel_degree='2' must be a number, got str; e\.g\. sharded_data_parallel_degree=1",
        ),
        ({"sdp_gradient_clipping": "1.0"}, r"sdp_gradient_clipping='1.0' must be a number, got str"),
        ({"sdp_reduce_bucket_size": 2.5}, r"sdp_reduce_bucket_size=2.5 must be a whole number"),
        ({"sdp_gradient_clipping": float("nan")}, r"sdp_gradient_clipping=nan must be a finite number; e\.g\."),
        ({"sdp_reduce_bucket_size": float("inf")}, r"sdp_reduce_bucket_size=inf must be a finite number"),
        ({"bf16": 1}, r"bf16=1 must be True or False, got int"),
        ({"sharded_data_parallel_degree": True}, r"sharded_data_parallel_degree=True must be a number, got bool"),
        ({"ddp_dist_backend": "mpi"}, r"ddp_dist_backend='mpi' is not one of \('auto', 'nccl', 'smddp'\); use 'auto'"),
        (
            {"sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2},
            r"tensor_parallel_degree=2 requires prescaled_batch=True \(each TP group reads one combined batch",
        ),
        # sdp 1 too: TP ranks reading their own data train copies that drift apart
        ({"tensor_parallel_degree": 2}, r"tensor_parallel_degree=2 requires prescaled_batch=True"),
        ({"ddp": False}, r"ddp=False is not supported: shardpar always runs with ddp=True"),
        ({"enabled": False, "parameters": {}}, r"enabled=False: shardpar needs 'enabled': True"),
        # the shm transport's limit, refused here rather than at the first shm collective
        ({"collective_timeout_s": 2e6}, r"collective_timeout_s=2000000\.0 must be <= 1e\+06; the default is 300\.0"),
    ],
)
def test_bad_knobs(knobs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        Config.from_any(knobs)


@pytest.mark.parametrize(
    ("env", "pattern"),
    [
        (
            {"SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES": "10000"},
            r"SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES=10000 must be a positive multiple of 8192 bytes; try 16384",
        ),
        (
            {"SMDDP_AG_SORT_BUFFER_SIZE_BYTES": "0"},
            r"SMDDP_AG_SORT_BUFFER_SIZE_BYTES=0 must be a positive multiple of 8192 bytes; try 8192",
        ),
        ({"SMDDP_AG_SORT_BUFFER_SIZE_BYTES": "-8192"}, r"SMDDP_AG_SORT_BUFFER_SIZE_BYTES=-8192 must be a positive"),
        (
            {"SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES": "16MB"},
            r"SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES='16MB' is not an integer; give a byte count",
        ),
    ],
)
def test_bad_smddp_buffer_env(env: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        Config.from_dict({}, env=env)


@pytest.mark.parametrize(
    ("env", "pattern"),
    [
        ({"SM_HP_MP_PARAMETERS": "{bad"}, r"the environment variable SM_HP_MP_PARAMETERS is not valid JSON \("),
        ({"SHARDPAR_CONFIG": '{"x": '}, r"the environment variable SHARDPAR_CONFIG is not valid JSON \("),
        ({"SM_HP_MP_PARAMETERS": "[]"}, r"SM_HP_MP_PARAMETERS must hold a JSON object of knobs, not list; e\.g\."),
    ],
)
def test_bad_json_names_its_source(env: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        Config.from_env(env)


def test_bad_config_files_are_named(tmp_path) -> None:
    for name, text, pattern in (("c.json", "{bad", "is not valid JSON"), ("c.toml", "x = = 1", "is not valid TOML")):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ValueError, match=f"config file '{path}' {pattern}"):
            Config.from_env({"SHARDPAR_CONFIG": str(path)})


def test_config_is_frozen_and_replace_revalidates() -> None:
    cfg = Config.from_dict({}, env={})
    with pytest.raises(AttributeError):
        cfg.bf16 = True  # type: ignore[misc]
    with pytest.raises(ValueError, match="fp16=True and bf16=True"):
        cfg.replace(fp16=True, bf16=True)
    with pytest.raises(TypeError, match="config must be a dict"):
        Config.from_any(42)  # type: ignore[arg-type]


@pytest.mark.parametrize("sdp, world", [(1, 4), (2, 4), (4, 8), (8, 8)])
def test_shard_optimizer_state_is_accepted_at_any_sdp(sdp: int, world: int) -> None:
    """Issue 23: the knob shards the fp32 state over the replicas too (refused at sdp > 1 until then);
    with one replica (sdp = world) it changes nothing and is accepted as well."""
    cfg = Config.from_dict({"sharded_data_parallel_degree": sdp, "shard_optimizer_state": True}, env={})
    cfg.check_world(world)
    assert cfg.shard_optimizer_state


def test_the_environment_overrides_the_scripts_config_key_by_key(tmp_path) -> None:
    """[Note: config precedence]: the script's dict < SM_HP_MP_PARAMETERS < SHARDPAR_CONFIG < SHARDPAR_<KNOB>.
    SageMaker v1's ModelParallelConfig copied SM_HP_MP_PARAMETERS over the dict given to smp.init."""
    script = {"sharded_data_parallel_degree": 2, "microbatches": 2, "bf16": True, "sdp_gradient_clipping": 0.5}
    env = {
        "SM_HP_MP_PARAMETERS": json.dumps({"sharded_data_parallel_degree": 4, "microbatches": 4, "partitions": 1}),
        "SHARDPAR_CONFIG": '{"microbatches": 8}',
        "SHARDPAR_SDP_GRADIENT_CLIPPING": "0",
        "SHARDPAR_TEST_POOL": "crash",  # the suite's own variable, not a knob
    }
    cfg = Config.from_any(script, env=env)
    assert cfg.sharded_data_parallel_degree == 4  # SM_HP_MP_PARAMETERS over the script
    assert cfg.microbatches == 8  # SHARDPAR_CONFIG over SM_HP_MP_PARAMETERS
    assert cfg.sdp_gradient_clipping == 0.0  # one knob's variable over everything
    assert cfg.bf16  # what no later source sets stays the script's
    assert cfg.overrides == (
        "sharded_data_parallel_degree=4 from SM_HP_MP_PARAMETERS replaces 2 from the script's config",
        "microbatches=4 from SM_HP_MP_PARAMETERS replaces 2 from the script's config",
        "microbatches=8 from SHARDPAR_CONFIG replaces 4 from SM_HP_MP_PARAMETERS",
        "sdp_gradient_clipping=0 from SHARDPAR_SDP_GRADIENT_CLIPPING replaces 0.5 from the script's config",
    )
    # The SageMaker form and a file behave as the flat dict; v1's alias of a knob is the knob.
    wrapped = {"enabled": True, "parameters": {"partitions": 1, "sharded_data_parallel_degree": 2}}
    assert Config.from_any(wrapped, env=env).sharded_data_parallel_degree == 4
    path = tmp_path / "c.toml"
    path.write_text("sharded_data_parallel_degree = 2\n")
    assert Config.from_any(path, env={"SHARDPAR_SHARDED_DATA_PARALLEL_DEGREE": "8"}).sharded_data_parallel_degree == 8
    assert Config.from_any(script, env={}).overrides == ()
    # A Config is final: it was resolved already (from_any applied the environment then).
    assert Config.from_any(cfg, env={"SHARDPAR_MICROBATCHES": "1"}) is cfg
    with pytest.raises(ValueError, match=r"environment variable SHARDPAR_MICROBATCHE: .*did you mean 'microbatches'"):
        Config.from_any(script, env={"SHARDPAR_MICROBATCHE": "1"})
