"""Every shardpar knob in one validated, frozen `Config`.

Names and defaults follow the SageMaker model parallel reference (003, "sharded data parallelism"):
a user can paste their `smp_options` dict unchanged. Validation happens in two stages, both before
any process group exists:

* `Config.from_any(...)` checks each knob on its own and the rules between knobs;
* `config.check_world(world)` checks the rules that need the world size (divisibility).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardpar.config_sources import (
    ACCEPTED_ONLY,
    SMDDP_BUFFER_ALIGN,
    env_layers,
    read_file,
    real_names,
    smddp_env,
    unknown_key_message,
    unwrap_sagemaker,
)
from shardpar.config_v1 import split_v1_keys

ENGINE_CHOICES = ("auto", "nccl", "smddp")
# How the parameters frozen at wrap time are held and gathered (runtime/frozen.py; issue 33 item 2).
FROZEN_BASE_MODES = ("gather", "keep_gathered", "int8", "nf4")


def _knob(
    default: Any, doc: str, *, minimum: float | None = None, exclusive: bool = False, maximum: float | None = None
) -> Any:
    return field(default=default, metadata={"doc": doc, "minimum": minimum, "exclusive": exclusive, "maximum": maximum})


@dataclass(frozen=True)
class Config:
    sharded_data_parallel_degree: int = _knob(1, "ranks a parameter is sharded over", minimum=1)
    tensor_parallel_degree: int = _knob(1, "ranks a layer is split over (TP groups form first)", minimum=1)
    pipeline_parallel_degree: int = _knob(1, "must be 1: MiCS does not compose with pipelines", minimum=1)
    shard_optimizer_state: bool = _knob(
        False,
        "each rank of a replication group owns 1/replicas of its shard's fp32 main values, main grads and "
        "optimizer state (1/(sdp x replicas) of the model's); at sdp 1 ZeRO-2 data parallelism",
    )
    sdp_reduce_bucket_size: int = _knob(
        int(5e8), "elements per gradient ReduceScatter bucket", minimum=0, exclusive=True
    )
    sdp_param_persistence_threshold: int = _knob(
        int(1e6), "parameters with fewer elements stay whole on every rank", minimum=0
    )
    sdp_max_live_parameters: int = _knob(int(1e9), "cap on unsharded elements alive at once", minimum=0, exclusive=True)
    sdp_hierarchical_allgather: bool = _knob(True, "intra-node/inter-node AllGather when groups span nodes")
    sdp_hierarchical_reduce_scatter: bool = _knob(
        True, "ReduceScatter inside each node first, then 1/ranks-per-node of it across nodes, when groups span nodes"
    )
    sdp_defer_cross_node_reduce: bool = _knob(
        False,
        "spanning groups: the cross-node hop of the gradient ReduceScatter waits for the accumulation boundary "
        "(node-reduced sums kept in fp32: nodes x the sharded gradients per rank during the window)",
    )
    sdp_quantize_cross_node_weights: bool = _knob(
        False, "spanning groups: the AllGather's cross-node step sends int8 blocks (ZeRO++ qwZ); lossy"
    )
    sdp_quantize_cross_node_gradients: bool = _knob(
        False,
        "spanning groups: the ReduceScatter's cross-node hop sends int8 blocks with error feedback (ZeRO++ qgZ); "
        "lossy; keeps nodes x the sharded gradients (fp32) per rank",
    )
    sdp_node_secondary_shard: bool = _knob(
        False,
        "spanning groups: a unit keeps its node's secondary shard (nodes x its shard, compute dtype) from its first "
        "cross-node AllGather until the optimizer step; every later gather of the step stays inside the node",
    )
    sdp_frozen_base_mode: str = _knob(
        "gather",
        "parameters frozen at wrap time (PEFT's base): gather (AllGathered per use) | keep_gathered (gathered once "
        "a step, kept to the optimizer step, where it fits) | int8 | nf4 (stored and AllGathered block-quantized, "
        "dequantized per use; lossy)",
    )
    sdp_gradient_clipping: float = _knob(1.0, "global L2 max norm applied in optimizer.step(); 0 = off", minimum=0)
    fp16: bool = _knob(False, "fp16 compute with loss scaling")
    bf16: bool = _knob(False, "bf16 compute")
    sdp_reduce_dtype: str = _knob("fp32", "dtype of gradient reductions: fp32 | bf16 | fp16 (= the compute dtype)")
    ddp_dist_backend: str = _knob("auto", "collective engine: auto | nccl (native torch.distributed) | smddp")
    prescaled_batch: bool = _knob(False, "the TP group reads one combined batch")
    delayed_parameter_initialization: bool = _knob(
        False, "the wrapped model must still be on meta (smp.delay_param_initialization()): ranks build only shards"
    )
    microbatches: int = _knob(1, "smp.step splits the batch into this many micro-batches", minimum=1)
    offload_activations: bool = _knob(
        False, "inputs kept by activation checkpoints leave the device after forward (api/activation_offload.py)"
    )
    activation_loading_horizon: int = _knob(
        4, "offloaded checkpoints reloaded this many checkpoints ahead of their backward", minimum=1
    )
    # shardpar's own knobs (not in the reference).
    ranks_per_node: int | None = _knob(None, "ranks per host; None = LOCAL_WORLD_SIZE", minimum=1)
    collective_timeout_s: float = _knob(
        300.0,
        "seconds any collective may wait before a peer is declared dead (whole-world groups of a default "
        "process group you started yourself keep its timeout)",
        minimum=0,
        exclusive=True,
        maximum=1e6,  # the shm transport's limit (MAX_TIMEOUT_S in shm_transport.c): checked here, not at a first call
    )
    collective_entry_timeout_s: float = _knob(
        30.0,
        "seconds a gathering call (model.state_dict(), save_pretrained, smp.save_checkpoint, smp.barrier()) waits "
        "for every rank to call it too before it raises, naming the ranks missing ([Note: collective entry])",
        minimum=0,
        exclusive=True,
        maximum=1e6,
    )
    sdp_max_nonfinite_steps: int = _knob(
        3,
        "consecutive optimizer steps skipped for a non-finite gradient norm or loss (bf16/fp32) before "
        "optimizer.step() raises; 0 = raise at the first",
        minimum=0,
    )
    checkpoint_snapshot_interval: int = _knob(
        0,
        "smp.save_snapshot(path, step) copies each rank's state into host shared memory when step % N == 0 "
        "(checkpoint/snapshot.py); 0 = off",
        minimum=0,
    )
    checkpoint_snapshot_dir: str = _knob("/dev/shm", "node-local directory of the in-memory snapshots")
    checkpoint_snapshot_job: str = _knob("", "name of the job's snapshots; empty: a hash of the checkpoint path")
    # Read from the SMDDP_* environment variables (reference 003, "Performance and memory tuning").
    smddp_ag_scratch_buffer_size_bytes: int = _knob(16 * 1024 * 1024, "env SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES")
    smddp_ag_sort_buffer_size_bytes: int = _knob(128 * 1024 * 1024, "env SMDDP_AG_SORT_BUFFER_SIZE_BYTES")
    # Not a knob: the SageMaker v1 keys that were accepted but change nothing here, one note each
    # (config_v1.py); smp.init warns once, on rank 0.
    v1_notes: tuple[str, ...] = field(default=(), repr=False, metadata={"internal": True})
    # Not a knob: which environment values replaced the script's ([Note: config precedence]).
    overrides: tuple[str, ...] = field(default=(), repr=False, compare=False, metadata={"internal": True})

    def __post_init__(self) -> None:
        for f in _knob_fields():
            object.__setattr__(self, f.name, _coerce(f, getattr(self, f.name)))
        self._check_rules()

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_any(
        cls,
        source: Config | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        *,
        env: Mapping[str, str] | None = None,
    ) -> Config:
        """Build from a Config (taken as it is), or from the script's flat or SageMaker-form dict, JSON/TOML
        path or None, with the environment over it key by key ([Note: config precedence])."""
        if isinstance(source, Config):
            return source
        if source is None:
            script: Mapping[str, Any] = {}
        elif isinstance(source, (str, os.PathLike)):
            script = read_file(Path(source))
        elif isinstance(source, Mapping):
            script = source
        else:
            raise TypeError(
                f"config must be a dict, a JSON/TOML file path or None (environment), got {type(source).__name__}"
            )
        env = os.environ if env is None else env
        return cls._from_layers([("the script's config", script), *env_layers(env, _knob_names())], env=env)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        """The environment alone: SM_HP_MP_PARAMETERS, SHARDPAR_CONFIG, SHARDPAR_<KNOB> (later wins)."""
        return cls.from_any(None, env=env)

    @classmethod
    def _from_layers(cls, layers: list[tuple[str, Mapping[str, Any]]], *, env: Mapping[str, str]) -> Config:
        """[Note: config precedence]
        Lowest first: the script's config (the dict, file or Config given to smp.init), then
        SM_HP_MP_PARAMETERS, SHARDPAR_CONFIG, and SHARDPAR_<KNOB>; a later source replaces an earlier one's
        value key by key. SageMaker model parallel v1 did the same with the first two: its
        ModelParallelConfig copied every key of SM_HP_MP_PARAMETERS (the launcher's `parameters`) over the
        dict the script passed to smp.init. The environment is set per launch, the script is shared by
        every launch, so the more specific source wins, and a single knob (SHARDPAR_<KNOB>) is the most
        specific of all. A value replaced is named in `overrides` (smp.init logs them on rank 0)."""
        merged: dict[str, Any] = {}
        origin: dict[str, str] = {}
        overrides: list[str] = []
        for where, raw in layers:
            for key, value in real_names(unwrap_sagemaker(raw)).items():
                if key in merged and merged[key] != value:
                    overrides.append(f"{key}={value!r} from {where} replaces {merged[key]!r} from {origin[key]}")
                merged[key], origin[key] = value, where
        return dataclasses.replace(cls.from_dict(merged, env=env), overrides=tuple(overrides))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, env: Mapping[str, str] | None = None) -> Config:
        """One flat or SageMaker-form dict of knobs, no environment (but the SMDDP_* buffer sizes)."""
        params, notes = split_v1_keys(real_names(unwrap_sagemaker(raw)))
        kwargs: dict[str, Any] = {**smddp_env(os.environ if env is None else env), "v1_notes": notes}
        names = _knob_names()
        for key, value in params.items():
            if key in ACCEPTED_ONLY:
                if value != ACCEPTED_ONLY[key]:
                    raise ValueError(f"{key}={value!r} is not supported: shardpar always runs with {key}=True")
                continue
            if key not in names:
                raise ValueError(unknown_key_message(key, names))
            kwargs[key] = value
        return cls(**kwargs)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    # ---- rules -------------------------------------------------------------------------------

    def _check_rules(self) -> None:
        if self.fp16 and self.bf16:
            raise ValueError("fp16=True and bf16=True were both set; choose one mixed-precision mode")
        if self.ddp_dist_backend not in ENGINE_CHOICES:
            raise ValueError(
                f"ddp_dist_backend={self.ddp_dist_backend!r} is not one of {ENGINE_CHOICES}; "
                "use 'auto' (smddp where supported), 'nccl' (native torch.distributed) or 'smddp'"
            )
        if self.sdp_frozen_base_mode not in FROZEN_BASE_MODES:
            raise ValueError(
                f"sdp_frozen_base_mode={self.sdp_frozen_base_mode!r} is not one of {FROZEN_BASE_MODES}; use 'gather' "
                "(the default: a frozen unit is AllGathered per use), 'keep_gathered' (once a step, memory "
                "permitting), or 'int8' / 'nf4' (a block-quantized frozen base, lossy)"
            )
        if self.sdp_reduce_dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(
                f"sdp_reduce_dtype={self.sdp_reduce_dtype!r} is not one of ('fp32', 'bf16', 'fp16'); "
                "use 'fp32' (default) or the compute dtype"
            )
        compute = "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"
        if self.sdp_reduce_dtype not in ("fp32", compute):
            raise ValueError(
                f"sdp_reduce_dtype={self.sdp_reduce_dtype!r} needs {self.sdp_reduce_dtype}=True (compute dtype is "
                f"{compute}); reduce in 'fp32' or in the compute dtype"
            )
        # Accepted for SageMaker compatibility at its default only: shardpar has no pipeline.
        if self.pipeline_parallel_degree > 1:
            raise ValueError(
                f"pipeline_parallel_degree={self.pipeline_parallel_degree}: shardpar has no pipeline parallelism "
                "(reference 003: sharded data parallelism does not compose with it); set pipeline_parallel_degree=1"
            )
        if self.tensor_parallel_degree > 1 and not self.prescaled_batch:
            # without it every TP rank would train on its own data, and nothing reduces gradients over TP
            # (SMP v1 all-gathers the batch inside the TP group instead; shardpar does not emulate that)
            raise ValueError(
                f"tensor_parallel_degree={self.tensor_parallel_degree} requires prescaled_batch=True (each TP "
                "group reads one combined batch: smp.rdp_slice); set it"
            )
        for knob, needs in (
            ("sdp_quantize_cross_node_weights", "sdp_hierarchical_allgather"),
            ("sdp_node_secondary_shard", "sdp_hierarchical_allgather"),
            ("sdp_quantize_cross_node_gradients", "sdp_hierarchical_reduce_scatter"),
            ("sdp_defer_cross_node_reduce", "sdp_hierarchical_reduce_scatter"),
        ):
            if getattr(self, knob) and not getattr(self, needs):
                # the knob acts on the hierarchical collective's cross-node step, which would not exist
                raise ValueError(f"{knob}=True acts on the cross-node step of {needs}, which is False; set both")
        for name in ("smddp_ag_scratch_buffer_size_bytes", "smddp_ag_sort_buffer_size_bytes"):
            value = getattr(self, name)
            if value <= 0 or value % SMDDP_BUFFER_ALIGN:
                env_name = name.upper()
                good = max(SMDDP_BUFFER_ALIGN, -(-value // SMDDP_BUFFER_ALIGN) * SMDDP_BUFFER_ALIGN)
                raise ValueError(
                    f"{env_name}={value} must be a positive multiple of {SMDDP_BUFFER_ALIGN} bytes; try {good}"
                )

    def check_world(self, world: int) -> None:
        """Rules that need the world size; raise before any process group is created."""
        tp, sdp = self.tensor_parallel_degree, self.sharded_data_parallel_degree
        # A world of one is most often a launch that started one process: say how to start N.
        alone = _ALONE if world == 1 else ""
        if world % tp:
            raise ValueError(
                f"tensor_parallel_degree={tp} must divide the world size {world}; try one of {_divisors(world)}{alone}"
            )
        rdp = world // tp
        if rdp % sdp:
            raise ValueError(
                f"sharded_data_parallel_degree={sdp} must divide the reduced data-parallel degree {rdp} "
                f"(world {world} / tensor_parallel_degree {tp}); try one of {_divisors(rdp)}{alone}"
            )
        rpn = self.ranks_per_node
        if rpn is not None and world % rpn:
            raise ValueError(f"ranks_per_node={rpn} must divide the world size {world}; try one of {_divisors(world)}")


# ---- helpers ---------------------------------------------------------------------------------

_ALONE = (
    ". This process runs alone (no launcher set WORLD_SIZE): start N ranks with `torchrun --nproc-per-node N "
    "train.py`; under accelerate on CPUs `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N "
    "train.py` (`accelerate launch --cpu` starts one process)"
)


def _divisors(n: int) -> str:
    divs = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, divs))


def _coerce(f: dataclasses.Field[Any], value: Any) -> Any:
    """Check the type of one knob (ints may be given as integral floats, like 5e8) and its bounds."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    name = f.name
    if value is None and "None" in kind:
        return None
    if kind.startswith("bool"):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} must be True or False, got {type(value).__name__}")
        return value
    if kind.startswith("str"):
        if not isinstance(value, str):
            raise ValueError(f"{name}={value!r} must be a string, got {type(value).__name__}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r} must be a number, got {type(value).__name__}; e.g. {name}={f.default!r}")
    if not math.isfinite(value):  # nan would silently turn a clipping threshold off; inf is no size
        raise ValueError(f"{name}={value!r} must be a finite number; e.g. {name}={f.default!r}")
    if kind.startswith("int"):
        if value != int(value):
            raise ValueError(f"{name}={value!r} must be a whole number")
        value = int(value)
    else:
        value = float(value)
    minimum, exclusive = f.metadata["minimum"], f.metadata["exclusive"]
    if minimum is not None and (value < minimum or (exclusive and value == minimum)):
        rule = f"> {minimum}" if exclusive else f">= {minimum}"
        raise ValueError(f"{name}={value!r} must be {rule}; the default is {f.default!r}")
    maximum = f.metadata["maximum"]
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value!r} must be <= {maximum:g}; the default is {f.default!r}")
    return value


def describe_knobs() -> list[tuple[str, Any, str]]:
    """(name, default, doc) of every knob, for the CLI and the docs."""
    return [(f.name, f.default, f.metadata["doc"]) for f in _knob_fields()]


def _knob_names() -> set[str]:
    return {f.name for f in _knob_fields()}


def _knob_fields() -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(Config) if not f.metadata.get("internal")]
