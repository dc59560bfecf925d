"""`shardpar estimate`: per-device memory of a sharded training job, and the smallest sharding degree
that fits. Pure arithmetic on the model's *unit* sizes -- the same units, persistence split and
padding that `DistributedModel` builds (sharding/plan.py, sharding/layout.py) -- so model-state bytes match what a
run keeps alive (tests/multiproc/test_recipe.py compares them with live tensors).

Per device, with S = this rank's sharded elements (sum over units of ceil(numel / tp / sdp)) and
P = persistent elements (numel < sdp_param_persistence_threshold, whole on every rank):

    model states   (4 main + c compute copy [mixed only] + 4 main grad + k optimizer) x (S + P)
                   with shard_optimizer_state over R replicas (S_o = this rank's piece, ~S / R; the
                   layout pads each unit to a multiple of sdp x R): c x (S + P) compute shard +
                   (4 main [mixed only: in fp32 the shard is the main copy] + 4 main grad + k) x S_o
                   + (4 + 4 + k) x P -- [Note: replica-sharded main] (runtime/replica_shard.py)
    gathered       c x live elements: the root unit (gathered through forward) + the current unit
                   + the prefetched next one while under sdp_max_live_parameters
    unit grads     c x (root + largest unit): autograd grads before they are reduce-scattered
    shard grads    shard_optimizer_state only: 4 x S, the shard's main grad from the end of a boundary
                   backward (or through an accumulation window) until its replication ReduceScatter
    reduce bucket  r x min(all, sdp_reduce_bucket_size + largest unit)
    activations    the tensors autograd saves per layer (see `_activations`), after Korthikanti et
                   al. 2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 2,
                   without dropout: c*s*b*h*(4 + 12/t) bytes, plus with eager attention the s x s
                   scores a*s*s*b/t x (4 fp32 softmax + c compute copy when mixed). Flash/SDPA
                   attention stores no scores. Checked against the bytes a tiny GPT-NeoX really
                   saves for backward (tests/unit/test_estimate.py).
                   Checkpointing keeps each layer's input (c*sbh) plus one layer being recomputed;
                   offloading moves the kept inputs to host memory (two stay in flight).
                   Logits: b*s*V/t elements x (c logits + c grad + 4 fp32 loss working set).
    framework      fixed: CUDA context, NCCL/SMDDP buffers, allocator slack (GPU); interpreter,
                   torch and transformers (CPU)

Peak = model states + framework + gathered + unit grads + kept activations + the larger working set:
the logits at the end of forward, or one layer's recompute plus the reduce bucket in backward. Model states are
exact for a given layout; the activation terms count a GPT-NeoX-style layer (4h GeLU MLP) and are
estimates for other layers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from shardpar.cli.model_shape import (  # re-exported: the CLI and tests read them from here
    REFERENCE_MODELS,
    ModelShape,
    reference_shape,
    shape_from_hf_config,
    shape_from_module,
    shape_from_num_params,
)

__all__ = [
    "REFERENCE_MODELS",
    "ModelShape",
    "reference_shape",
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
CPU_FRAMEWORK_BYTES = GiB // 2
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd-momentum": 4, "sgd": 0}


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
    flash_attention: bool = True
    optimizer: str = "adamw"
    reduce_dtype: str = "fp32"
    max_live_parameters: int = int(1e9)
    reduce_bucket_size: int = int(5e8)
    device: str = "a100-40gb"  # a DEVICES key or "cpu"
    device_bytes: int | None = None  # overrides the device's capacity
    shard_optimizer_state: bool = False  # the fp32 state split over the replicas too
    world: int | None = None  # devices in all: the replicas are world / (tp x sdp) (None: one replica)

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
        for name in ("sdp", "tp", "batch", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.world is not None and (self.world < 1 or self.world % (self.tp * self.sdp)):
            raise ValueError(f"world={self.world} must be a multiple of tp {self.tp} x sdp {self.sdp}")

    @property
    def replicas(self) -> int:
        """Sharding groups of one TP rank: the replication degree."""
        return 1 if self.world is None else self.world // (self.tp * self.sdp)

    @property
    def capacity(self) -> int | None:
        if self.device_bytes is not None:
            return self.device_bytes
        return DEVICES.get(self.device)


@dataclass(frozen=True)
class Estimate:
    shape: ModelShape
    setup: Setup
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def model_states(self) -> int:
        return sum(v for k, v in self.parts.items() if k.startswith("model states"))

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


def estimate(shape: ModelShape, setup: Setup) -> Estimate:
    c = DTYPE_BYTES[setup.precision]
    r = DTYPE_BYTES[setup.reduce_dtype]
    units = [math.ceil(n / setup.tp) for n in shape.unit_numels]  # TP splits every sharded unit
    split = setup.replicas if setup.shard_optimizer_state else 1
    owned = sum(math.ceil(n / (setup.sdp * split)) for n in units)  # this rank's piece of its shards
    sharded = owned * split  # its shards, padded to a multiple of the replicas
    p = shape.persistent_numel
    mixed = c != 4
    parts = {
        "model states: fp32 main parameters": 4 * ((owned if mixed else sharded) + p),
        "model states: compute-dtype copies": c * (sharded + p) if mixed else 0,
        "model states: fp32 gradients": 4 * (owned + p),
        "model states: optimizer state": OPTIMIZER_STATE_BYTES[setup.optimizer] * (owned + p),
        "model states: buffers": shape.buffer_bytes,
    }
    root, layers = (units[0], units[1:]) if units else (0, [])
    biggest = max(layers, default=0)
    parts["gathered units"] = c * _peak_live(root, layers, setup.max_live_parameters)
    parts["unit gradients"] = c * (root + biggest)
    parts["shard gradients before their ReduceScatter"] = 4 * sharded if split > 1 else 0
    bucket = r * min(sum(units), setup.reduce_bucket_size + max(units, default=0))
    kept, working, logits = _activations(shape, setup, c)
    parts["activations kept for backward"] = kept
    parts["working set: max(logits, layer + bucket)"] = max(logits, working + bucket)
    parts["framework"] = CPU_FRAMEWORK_BYTES if setup.device == "cpu" else GPU_FRAMEWORK_BYTES
    return Estimate(shape, setup, parts)


def _peak_live(root: int, layers: list[int], cap: int) -> int:
    """The scheduler's peak: root + current unit, plus the next unit when that stays under the cap."""
    peak = root
    for i, n in enumerate(layers):
        nxt = layers[i + 1] if i + 1 < len(layers) else 0
        live = root + n
        peak = max(peak, live + nxt if live + nxt <= cap else live)
    return peak


def _activations(shape: ModelShape, setup: Setup, c: int) -> tuple[int, int, int]:
    """(bytes kept across the whole pass, one layer's working set, logits working set).

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
    """
    s, b, h, t = setup.seq, setup.batch, shape.hidden, setup.tp
    a, layers = max(1, shape.num_heads), shape.num_layers
    sbh = s * b * h
    score_bytes = 4 + (c if c < 4 else 0)
    scores = 0.0 if setup.flash_attention else a * s * s * b / t * score_bytes
    per_layer = int(sbh * c * (4 + 12 / t) + scores)
    logits = int(s * b * math.ceil(shape.vocab / t) * (2 * c + 4))
    if not setup.activation_checkpointing:
        return layers * per_layer, 0, logits
    kept_inputs = (min(2, layers) if setup.activation_offloading else layers) * sbh * c
    return kept_inputs, per_layer, logits


# ---- recommendations -----------------------------------------------------------------------------


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def smallest_fitting_sdp(shape: ModelShape, setup: Setup, world: int) -> Estimate | None:
    """The fitting estimate with the smallest sdp dividing world / tp (reference 003: start small)."""
    if world % setup.tp:
        raise ValueError(f"tensor_parallel_degree={setup.tp} must divide the world size {world}")
    for sdp in divisors(world // setup.tp):
        est = estimate(shape, replace(setup, sdp=sdp, world=world))
        if est.fits:
            return est
    return None


def alternatives(shape: ModelShape, setup: Setup, world: int, tps: Iterable[int] = (1, 2, 4, 8)) -> list[Estimate]:
    """When nothing fits: the smallest fitting sdp per (tp, checkpointing, offloading) variant."""
    found: list[Estimate] = []
    for tp in tps:
        if world % tp:
            continue
        for ckpt, offload in (
            (setup.activation_checkpointing, setup.activation_offloading),
            (True, False),
            (True, True),
        ):
            variant = replace(setup, tp=tp, sdp=1, activation_checkpointing=ckpt, activation_offloading=offload)
            est = smallest_fitting_sdp(shape, variant, world)
            if est is not None and all(e.setup != est.setup for e in found):
                found.append(est)
                break
    return found


def tp_from_global_batch(world: int, global_batch: int, batch: int, accum: int = 1) -> int:
    """Reference 003: tensor parallelism lowers the global batch; tp = world / (global / (batch x accum))."""
    if global_batch % (batch * accum):
        raise ValueError(f"global batch {global_batch} is not a multiple of batch {batch} x accumulation {accum}")
    rdp = global_batch // (batch * accum)
    if rdp == 0 or world % rdp:
        raise ValueError(
            f"global batch {global_batch} / (batch {batch} x accumulation {accum}) = {rdp} data-parallel "
            f"ranks must divide the world size {world}"
        )
    return world // rdp


def format_estimate(est: Estimate) -> str:
    cap = est.setup.capacity
    lines = [f"  {k:42s} {v / GiB:9.2f} GiB" for k, v in est.parts.items() if v]
    verdict = "" if cap is None else f" of {cap / GiB:.1f} GiB -> {'fits' if est.fits else 'does NOT fit'}"
    lines.append(f"  {'total per device':42s} {est.total / GiB:9.2f} GiB{verdict}")
    return "\n".join(lines)
