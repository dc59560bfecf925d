"""`shardpar estimate`: per-device memory of a sharded training job, and the smallest sharding degree
that fits. Pure arithmetic on the model's *unit* sizes -- the same units, persistence split and
padding that `DistributedModel` builds (sharding/plan.py, sharding/layout.py) -- walked through one
training step the way the runtime allocates (memory_model.py): the figure is the step's peak.

Per device, with S = this rank's sharded elements (sum over units of ceil(numel / tp / sdp)) and
P = persistent elements (numel < sdp_param_persistence_threshold, whole on every rank):

    model states   (4 main + c compute copy [mixed only] + 4 main grad + k optimizer) x (S + P);
                   with shard_optimizer_state over R replicas the fp32 main [mixed only], main grad and
                   optimizer state are this rank's piece of S, ~S / R ([Note: replica-sharded main])
    gathered       c x the units the scheduler holds gathered (root, current, prefetched), sdp > 1
    activations    the tensors autograd saves per layer (see `activation_bytes`), after Korthikanti et
                   al. 2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 2,
                   without dropout; the logits and the loss's working set
    gradients      a unit's full gradients until they reach the reduce bucket; the bucket
                   (sdp_reduce_bucket_size elements); the main gradients reduced so far (with
                   shard_optimizer_state, shard-sized until the boundary's replication ReduceScatter)
    framework      fixed: CUDA context, NCCL/SMDDP buffers, allocator slack (GPU); interpreter,
                   torch, transformers and gloo (CPU, measured)

The peak is the largest sum over the step's moments (memory_model.py). Model states are exact for a
given layout; the activation terms count a GPT-NeoX-style layer (4h GeLU MLP) and are estimates for
other layers. The CPU figures are checked against the per-rank VmHWM of real runs, within 10 %
(tests/unit/test_estimate.py): they assume freed memory goes back to the OS (MALLOC_MMAP_THRESHOLD_,
docs/performance.md "Memory"); glibc's defaults keep freed blocks in a fragmented heap on top.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from shardpar.cli import memory_model as mm
from shardpar.cli.model_shape import (  # re-exported: the CLI and tests read them from here
    REFERENCE_MODELS,
    ModelShape,
    reference_shape,
    shape_from_dims,
    shape_from_hf_config,
    shape_from_module,
    shape_from_num_params,
)

__all__ = [
    "REFERENCE_MODELS",
    "ModelShape",
    "reference_shape",
    "shape_from_dims",
    "shape_from_hf_config",
    "shape_from_module",
    "shape_from_num_params",
]

GiB = 1024**3

# instance type -> (devices per instance, device name)
INSTANCES = {
    "p4d.24xlarge": (8, "a100-40gb"),
    "p4de.24xlarge": (8, "a100-80gb"),
    "p5.48xlarge": (8, "h100-80gb"),
    "p3.16xlarge": (8, "v100-16gb"),
    "p3dn.24xlarge": (8, "v100-32gb"),
    "g5.48xlarge": (8, "a10g-24gb"),
}
DEVICES = {
    "a100-40gb": 40 * GiB,
    "a100-80gb": 80 * GiB,
    "h100-80gb": 80 * GiB,
    "h200-141gb": 141 * 10**9,
    "v100-16gb": 16 * GiB,
    "v100-32gb": 32 * GiB,
    "a10g-24gb": 24 * GiB,
}
GPU_FRAMEWORK_BYTES = 2 * GiB
# A CPU rank before its model exists: Python, torch, transformers, a gloo process group (measured
# 344 MiB with torch 2.13 and transformers 5.24, benchmarks/bench_memory.py "baseline").
CPU_FRAMEWORK_BYTES = 350 * 2**20
# What a CPU training step adds to that for good: library code first run by forward, backward and
# the optimizer (libtorch_cpu.so's resident pages grow by ~22 MiB, /proc/self/smaps).
CPU_STEP_CODE_BYTES = 24 * 2**20
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# fp32 bytes per stepped element. Owner compute (muon, adafactor: cli/owner_estimate.py) adds the owner's
# whole fp32 copy of what it owns, ~4 per element on average: Muon's momentum (AdamW's two moments for
# the rest) + 4; Adafactor's factored statistics are ~0 per element, so its 4 is the copy.
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd-momentum": 4, "sgd": 0, "muon": 8, "adafactor": 4}


@dataclass(frozen=True)
class Setup:
    """A job: topology, batch, precision and the shardpar knobs that change memory."""

    sdp: int = 1
    tp: int = 1
    batch: int = 1  # sequences per data-parallel rank (per TP group) per micro-step
    seq: int = 2048
    precision: str = "bf16"
    activation_checkpointing: bool = False
    activation_offloading: bool = False
    activation_loading_horizon: int = 4  # the knob: with offloading, horizon + 1 inputs back on the device
    flash_attention: bool = True
    optimizer: str = "adamw"
    reduce_dtype: str = "fp32"
    max_live_parameters: int = int(1e9)
    reduce_bucket_size: int = int(5e8)
    device: str = "a100-40gb"  # a DEVICES key or "cpu"
    device_bytes: int | None = None  # overrides the device's capacity
    framework_bytes: int | None = None  # overrides the framework term (a measured baseline)
    shard_optimizer_state: bool = False  # the fp32 state split over the replicas too
    world: int | None = None  # devices in all: the replicas are world / (tp x sdp) (None: one replica)
    # CPU: glibc's MALLOC_MMAP_THRESHOLD_ (bytes); freed blocks below it stay with the process
    mmap_threshold: int = 1 << 20
    engine: str = "smddp"  # on CPU: "smddp" (ddp_dist_backend auto) or "native" (gloo)
    # Sharding groups that span nodes (issue 28): ranks a node, and the two knobs that cost memory there.
    ranks_per_node: int | None = None
    node_secondary_shard: bool = False
    defer_cross_node_reduce: bool = False
    quantize_cross_node: bool = False
    accum: int = 1

    def __post_init__(self) -> None:
        if self.precision not in DTYPE_BYTES:
            raise ValueError(f"precision={self.precision!r} is not one of {sorted(DTYPE_BYTES)}")
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise ValueError(f"optimizer={self.optimizer!r} is not one of {sorted(OPTIMIZER_STATE_BYTES)}")
        if self.device != "cpu" and self.device not in DEVICES and self.device_bytes is None:
            raise ValueError(f"device={self.device!r} is not one of {sorted(DEVICES)} or 'cpu'; or give device_bytes")
        if self.activation_offloading and not self.activation_checkpointing:
            raise ValueError(
                "activation offloading moves the checkpointed layer inputs: enable activation checkpointing"
            )
        for name in ("sdp", "tp", "batch", "seq", "activation_loading_horizon"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.engine not in ("smddp", "native"):
            raise ValueError(f"engine={self.engine!r} is not 'smddp' or 'native'")
        if self.world is not None and (self.world < 1 or self.world % (self.tp * self.sdp)):
            raise ValueError(f"world={self.world} must be a multiple of tp {self.tp} x sdp {self.sdp}")

    @property
    def replicas(self) -> int:
        """Sharding groups of one TP rank: the replication degree."""
        return 1 if self.world is None else self.world // (self.tp * self.sdp)

    @property
    def split(self) -> int:
        """How many pieces the fp32 state of a shard is cut into: the replicas with shard_optimizer_state."""
        return self.replicas if self.shard_optimizer_state else 1

    @property
    def capacity(self) -> int | None:
        if self.device_bytes is not None:
            return self.device_bytes
        return DEVICES.get(self.device)


@dataclass(frozen=True)
class Estimate:
    """The step's peak, by part (`parts` sums to `total`); `peak_at` names the moment."""

    shape: ModelShape
    setup: Setup
    parts: dict[str, int] = field(default_factory=dict)
    peak_at: str = ""
    model_state_bytes: int = 0  # every model state at full size, gradients included

    @property
    def model_states(self) -> int:
        return self.model_state_bytes

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool | None:
        cap = self.setup.capacity
        return None if cap is None else self.total <= cap


@dataclass(frozen=True)
class ReferenceRow:
    """One row of reference 003's tables (activation checkpointing on, as in SageMaker's examples)."""

    model: str
    instances: int
    instance_type: str
    seq: int
    global_batch: int
    mini_batch: int
    sdp: int
    tp: int = 1
    offload: bool = False

    @property
    def world(self) -> int:
        return self.instances * INSTANCES[self.instance_type][0]

    def setup(self, **changes: Any) -> Setup:
        base = Setup(
            sdp=self.sdp,
            tp=self.tp,
            batch=self.mini_batch,
            seq=self.seq,
            precision="bf16",
            activation_checkpointing=True,
            activation_offloading=self.offload,
            device=INSTANCES[self.instance_type][1],
            world=self.world,
        )
        return replace(base, **changes)


REFERENCE_ROWS = (
    ReferenceRow("gpt-neox-20b", 2, "p4d.24xlarge", 2048, 64, 4, 16),
    ReferenceRow("gpt-neox-20b", 8, "p4d.24xlarge", 2048, 768, 12, 32),
    ReferenceRow("gpt-neox-65b", 64, "p4d.24xlarge", 2048, 512, 8, 16, tp=8, offload=True),
    ReferenceRow("gpt-neox-65b", 64, "p4d.24xlarge", 4096, 512, 2, 64, tp=2, offload=True),
)


# ---- the estimate --------------------------------------------------------------------------------


def _states(shape: ModelShape, setup: Setup) -> dict[str, int]:
    """Every model state but the gradients, at full size. With shard_optimizer_state the fp32 state
    is this rank's piece of its shard ([Note: replica-sharded main], runtime/replica_shard.py); in
    fp32 the compute shard *is* the main shard, so the main values stay shard-sized."""
    c = DTYPE_BYTES[setup.precision]
    p = shape.persistent_numel
    owned, sharded = _owned(shape, setup), _sharded(shape, setup)
    mixed = c != 4
    return {
        "model states: fp32 main parameters": 4 * ((owned if mixed else sharded) + p),
        "model states: compute-dtype copies": c * (sharded + p) if mixed else 0,
        "model states: optimizer state": OPTIMIZER_STATE_BYTES[setup.optimizer] * (owned + p),
        "model states: buffers": shape.buffer_bytes,
    }


def _owned(shape: ModelShape, setup: Setup) -> int:
    """This rank's piece of its shards: the fp32 state it steps (its whole shards without the knob)."""
    pieces = setup.sdp * setup.split
    return sum(math.ceil(math.ceil(n / setup.tp) / pieces) for n in shape.unit_numels)


def _sharded(shape: ModelShape, setup: Setup) -> int:
    """This rank's shards, each unit padded to a multiple of sdp (x the replicas with the knob)."""
    return _owned(shape, setup) * setup.split


def _framework(setup: Setup) -> int:
    """The process before its model exists (given, or this device's), and on CPU the code a step runs."""
    if setup.device != "cpu":
        return GPU_FRAMEWORK_BYTES if setup.framework_bytes is None else setup.framework_bytes
    base = CPU_FRAMEWORK_BYTES if setup.framework_bytes is None else setup.framework_bytes
    return base + CPU_STEP_CODE_BYTES


def step_inputs(shape: ModelShape, setup: Setup) -> mm.StepInputs:
    """The walk's inputs for this job (memory_model.py): bytes per unit and per state."""
    c, r = DTYPE_BYTES[setup.precision], DTYPE_BYTES[setup.reduce_dtype]
    cpu, sdp = setup.device == "cpu", setup.sdp
    numels = [math.ceil(n / setup.tp) for n in shape.unit_numels]  # TP splits every sharded unit
    padded = [mm.ceil_to(n, sdp * setup.split) for n in numels]  # the layout's padding
    gathered = [c * p if sdp > 1 else 0 for p in padded]
    small = shape.persistent_per_unit
    units = tuple(
        mm.UnitBytes(
            kind=kind,
            gathered=g,
            scratch=mm.gather_scratch(g, c * p // sdp, cpu=cpu, smddp=setup.engine == "smddp"),
            grads=r * p,
            shard=r * p // sdp,
            numel=p,
            persistent_grads=c * q,
        )
        for kind, g, p, q in zip(shape.kinds[1:], gathered[1:], padded[1:], small[1:], strict=True)
    )
    kept, work, logits = activation_bytes(shape, setup)
    retained = _retained_by_heap(shape, setup) if cpu else 0
    piece = math.ceil(math.ceil(shape.max_tensor_numel / setup.tp) / (sdp * setup.split))
    n = _owned(shape, setup) + shape.persistent_numel  # the fp32 elements the optimizer steps
    return mm.StepInputs(
        states=sum(_states(shape, setup).values()) + _framework(setup),
        main_grads=4 * n,
        # shard_optimizer_state: the shard-sized main grads of a boundary backward, until the
        # replication ReduceScatter leaves this rank its piece (runtime/replica_shard.py)
        shard_grads=4 * _sharded(shape, setup) if setup.split > 1 else 0,
        root_persistent_grads=c * small[0] if small else 0,
        persistent_payload=r * shape.persistent_numel if sdp * setup.replicas > 1 else 0,
        root_gathered=gathered[0] if numels else 0,
        root_numel=padded[0] if numels else 0,
        units=units,
        cap=setup.max_live_parameters,
        bucket_numel=setup.reduce_bucket_size,
        in_place=cpu and sdp > 1 and setup.engine == "smddp",
        layer_kept=kept,
        layer_work=work,
        logits=logits,
        # torch's AdamW: per tensor on CPU (a sqrt and a quotient of the largest piece), foreach on CUDA
        optimizer_temp=2 * 4 * piece if cpu else 4 * n,
        layer_retained=min(retained, kept),
    )


def _retained_by_heap(shape: ModelShape, setup: Setup) -> int:
    """The bytes of one layer's saved activations in tensors below the mmap threshold (see
    `activation_bytes` for the tensors): s*b*h-sized ones (layer-norm, projection and attention
    inputs, Q, K, V: 4 + 4/t of them) and 4h-wide ones (the GeLU's input and output: 2)."""
    c = DTYPE_BYTES[setup.precision]
    narrow = c * setup.seq * setup.batch * shape.hidden
    t = setup.tp
    kept = 0
    if narrow < setup.mmap_threshold:
        kept += int(narrow * (4 + 4 / t))
    if 4 * narrow / t < setup.mmap_threshold:
        kept += int(narrow * 8 / t)
    return kept


_PART_LABELS = {
    "gathered": "gathered units",
    "gather scratch": "gather scratch (gloo)",
    "activations": "activations and logits",
    "unit gradients": "unit gradients",
    "reduce bucket": "reduce bucket",
    "optimizer temporaries": "optimizer temporaries",
}


def estimate(shape: ModelShape, setup: Setup) -> Estimate:
    """The step's peak per device, broken into its parts at that moment (memory_model.py)."""
    states = _states(shape, setup)
    moment = mm.peak(step_inputs(shape, setup))
    parts = dict(states)
    parts["model states: fp32 gradients"] = moment.parts.get("main gradients", 0)
    parts["shard gradients before their ReduceScatter"] = moment.parts.get("shard gradients", 0)
    for key, label in _PART_LABELS.items():
        parts[label] = moment.parts.get(key, 0)
    parts.update(_cross_node_states(shape, setup))
    parts["framework"] = _framework(setup)
    full = sum(states.values()) + 4 * (_owned(shape, setup) + shape.persistent_numel)
    return Estimate(shape, setup, parts, peak_at=moment.where, model_state_bytes=full)


def _cross_node_states(shape: ModelShape, setup: Setup) -> dict[str, int]:
    """What sdp_node_secondary_shard and sdp_defer_cross_node_reduce keep per rank (cli/cross_node.py)."""
    if setup.ranks_per_node is None:
        return {}
    from shardpar.cli import cross_node
    from shardpar.topology import plan

    world = setup.world or setup.sdp * setup.tp
    knobs = cross_node.knobs_of(setup)
    layout = plan(world, setup.tp, setup.sdp, min(setup.ranks_per_node, world))
    return cross_node.extra_state_bytes(layout, sum(shape.unit_numels), knobs)


def floor(shape: ModelShape, setup: Setup) -> int:
    """Issue 19's analytical floor: the framework + every model state at full size (sharded
    parameters, gradients, optimizer state) + the largest set of units the scheduler holds gathered
    under the live cap + one reduce bucket + every layer's activations and the logits. A sum of
    terms that a step does not all hold at once: a floor for the peak's composition, not a bound."""
    x = step_inputs(shape, setup)
    units = list(x.units)
    live = max((mm.gathered_at(x, units, i)[0] for i in range(len(units))), default=x.root_gathered)
    total_numel = sum(u.numel for u in units) + x.root_numel
    bucket = DTYPE_BYTES[setup.reduce_dtype] * min(setup.reduce_bucket_size, total_numel)
    layers = shape.kinds.count("block")
    return x.states + x.main_grads + live + bucket + layers * x.layer_kept + x.logits


def activation_bytes(shape: ModelShape, setup: Setup) -> tuple[int, int, int]:
    """(bytes one layer keeps for backward, one layer's working set while it recomputes, the logits
    and the loss's working set).

    What one layer saves for backward, in bytes (Korthikanti et al. eq. 2 with tp = t and no sequence
    parallelism; c = bytes per activation; counts in s*b*h elements):

        replicated over TP   4 c sbh      layer-norm inputs 2, QKV-projection input 1, MLP input 1
        split over TP        12 c sbh / t Q and K 2, V 1, output-projection input 1,
                                          GeLU input (the 4h up-projection) 4, GeLU output 4
        eager attention      a s s b / t  x (4 + c if c < 4 else 4): the fp32 softmax output
                                          (Hugging Face upcasts it) and its compute-dtype copy

    The paper's 34 sbh (c = 2) also counts two 1-byte dropout masks, and its 5as/h a 2-byte softmax
    plus attention dropout (mask and output): the models trained here use no dropout, and Hugging
    Face keeps 4 + c bytes per score (6 in bf16; 4 in fp32, where the paper scaled to 4 bytes gives 10).
    Measured (tests/unit/test_estimate.py): GPT-NeoX's two layer norms share one input (parallel
    residual) while SDPA also keeps its output, so the count holds within a few percent.
    With checkpointing a layer keeps its input (c sbh) and recomputes the rest in its backward;
    offloading moves the kept inputs to host memory; backward reloads the one it recomputes and the
    activation_loading_horizon ones queued before it (api/activation_offload.py), so horizon + 1 are
    back on the device while a layer recomputes.
    Logits: b*s*V/t elements x (c logits + c grad + 4 fp32 loss working set).
    """
    c = DTYPE_BYTES[setup.precision]
    s, b, h, t = setup.seq, setup.batch, shape.hidden, setup.tp
    a = max(1, shape.num_heads)
    sbh = s * b * h
    score_bytes = 4 + (c if c < 4 else 0)
    scores = 0.0 if setup.flash_attention else a * s * s * b / t * score_bytes
    per_layer = int(sbh * c * (4 + 12 / t) + scores)
    logits = int(s * b * math.ceil(shape.vocab / t) * (2 * c + 4))
    if not setup.activation_checkpointing:
        return per_layer, 0, logits
    if setup.activation_offloading:
        return 0, per_layer + (setup.activation_loading_horizon + 1) * sbh * c, logits
    return sbh * c, per_layer, logits


def format_estimate(est: Estimate) -> str:
    cap = est.setup.capacity
    lines = [f"  peak: {est.peak_at}"] + [f"  {k:42s} {v / GiB:9.2f} GiB" for k, v in est.parts.items() if v]
    verdict = "" if cap is None else f" of {cap / GiB:.1f} GiB -> {'fits' if est.fits else 'does NOT fit'}"
    lines.append(f"  {'total per device':42s} {est.total / GiB:9.2f} GiB{verdict}")
    return "\n".join(lines)
