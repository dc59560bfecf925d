"""`shardpar estimate --lora-rank R --frozen-dtype bf16|int8|nf4`: per-rank model states of a LoRA
fine-tune (issue 33) and the size of its checkpoints. Arithmetic on the model's units (model_shape.py)
and the way the runtime holds each kind of tensor:

    frozen base, sharded     its units' elements / sdp in bf16 (runtime/frozen.py); with
                             --frozen-dtype int8 / nf4 (`sdp_frozen_base_mode`) its codes instead: int8
                             1 byte + one fp32 scale per 64-value block (1.0625), nf4 0.5 byte + the
                             scale (0.5625) -- the runtime drops the exact bf16 shard once quantized
                             (runtime/frozen_exact.py), so a quantized mode cuts stored and gathered bytes
    small frozen tensors     (the base's biases and layer norms) sharded with their unit's frozen
                             shard whatever their size: only trained parameters persist
                             (model_build.split_persistent). Under int8 / nf4 the 1-D ones are not
                             quantized (as in QLoRA): whole on every rank, fp32 main, compute copy, grad
                             (a GPT-NeoX block's 9 x hidden + MLP width); small matrices are quantized
    persistent tensors       (adapters under sdp_param_persistence_threshold) whole on every rank: fp32
                             main copy, a compute-dtype copy under bf16/fp16, an fp32 main grad
    adapters                 LoRA A (r x in) and B (out x r) on every attention and MLP linear of a
                             GPT-NeoX layer (query_key_value, dense, dense_h_to_4h, dense_4h_to_h):
                             r (8 hidden + 2 mlp width) per layer; fp32 main + compute copy + fp32 grad + optimizer
                             state; sharded like any trained tensor when one reaches the threshold
    gathered per use         one block unit at a time in the compute dtype (dequantized when int8/nf4),
                             the prefetched next one beside it

Checkpoints: an adapter-only partial checkpoint (checkpoint/fingerprint.py) writes the adapters' fp32
values and optimizer state plus the frozen base's fingerprint (a checksum per tensor in the index); a
partial checkpoint storing the base would add it in its dtype; a full export is fp32 (default full_dtype).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from shardpar.cli.model_shape import ModelShape

FROZEN_BYTES = {"bf16": 2.0, "int8": 1 + 4 / 64, "nf4": 0.5 + 4 / 64}
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd-momentum": 4, "sgd": 0}
FINGERPRINT_BYTES_PER_TENSOR = 160  # one "frozen" index entry: name, shape, dtype, checksum (JSON)
MiB = 2**20


@dataclass(frozen=True)
class LoraEstimate:
    """Per-rank model-state bytes of a LoRA fine-tune, by part, and checkpoint sizes (bytes)."""

    sdp: int
    adapter_numel: int
    frozen_sharded: int  # the frozen base's shard in bf16 (0 under int8 / nf4: dropped once quantized)
    frozen_codes: int  # int8 / nf4: that shard quantized, what the runtime stores and gathers
    frozen_persistent: int  # int8 / nf4: small frozen tensors, whole: main + compute copy + main grad
    adapter_states: int  # adapters: main + compute copy + grad + optimizer state
    gathered: int  # transient: the units gathered for compute (current + prefetched)
    checkpoint_adapter_only: int
    checkpoint_with_base: int
    checkpoint_full: int

    @property
    def model_states(self) -> int:
        return self.frozen_sharded + self.frozen_codes + self.frozen_persistent + self.adapter_states


def mlp_width(shape: ModelShape) -> int:
    """A GPT-NeoX block's MLP width, from its parameter count: 4h^2 attention + 2hf MLP weights, 3h + h +
    f + h biases and two layer norms (4h); 4 x hidden when the shape has no block to count."""
    h = shape.hidden
    totals = [s + p for s, p in zip(shape.unit_numels, shape.persistent_per_unit, strict=True)]
    blocks = [n for n, k in zip(totals, shape.kinds, strict=True) if k == "block"]
    if not blocks or h == 0:
        return 4 * h
    return max(1, round((blocks[0] - 4 * h * h - 9 * h) / (2 * h + 1)))


def _one_dim(shape: ModelShape, kind: str, persistent: int) -> int:
    """A unit's small frozen 1-D tensors (biases, layer norms): a GPT-NeoX block's 3h + h + f + h biases
    and two layer norms (4h); another unit's, a layer norm (the final one: 2h) -- its small matrices
    (embeddings, a head under the threshold) are quantized."""
    one_dim = 9 * shape.hidden + mlp_width(shape) if kind == "block" else 2 * shape.hidden
    return min(persistent, one_dim)


def adapter_tensors(shape: ModelShape, rank: int) -> list[int]:
    """Element counts of the LoRA A and B tensors on the attention and MLP linears of every layer."""
    h, ffn = shape.hidden, mlp_width(shape)
    linears = [(h, 3 * h), (h, h), (h, ffn), (ffn, h)]  # (in, out): qkv, dense, h->4h, 4h->h
    return [n for _ in range(shape.num_layers) for i, o in linears for n in (rank * i, o * rank)]


def estimate_lora(
    shape: ModelShape,
    *,
    rank: int,
    sdp: int,
    frozen_dtype: str = "bf16",
    precision: str = "bf16",
    optimizer: str = "adamw",
    persistence_threshold: int = int(1e6),
) -> LoraEstimate:
    if rank < 1:
        raise ValueError(f"--lora-rank {rank} must be >= 1 (the adapters' rank r)")
    if frozen_dtype not in FROZEN_BYTES:
        raise ValueError(f"--frozen-dtype {frozen_dtype!r} is not one of {sorted(FROZEN_BYTES)}")
    c = COMPUTE_BYTES[precision]
    copy = c if c != 4 else 0  # a separate compute copy only under mixed precision
    state = OPTIMIZER_STATE_BYTES[optimizer]
    adapters = adapter_tensors(shape, rank)
    whole = sum(n for n in adapters if n < persistence_threshold)
    split = sum(math.ceil(n / sdp) for n in adapters if n >= persistence_threshold)
    per_adapter = 4 + copy + 4 + state
    # every frozen tensor is sharded, the small ones with their unit (only trained parameters persist),
    # except under a quantized base, whose small frozen tensors persist unquantized
    quantized = frozen_dtype != "bf16"
    one_dim = [
        _one_dim(shape, k, p) if quantized else 0 for k, p in zip(shape.kinds, shape.persistent_per_unit, strict=True)
    ]
    totals = [u + p - d for u, p, d in zip(shape.unit_numels, shape.persistent_per_unit, one_dim, strict=True)]
    sharded_base = sum(math.ceil(n / sdp) for n in totals)
    blocks = [n for n, k in zip(totals, shape.kinds, strict=True) if k == "block"] or [0]
    fingerprint = FINGERPRINT_BYTES_PER_TENSOR * (12 * shape.num_layers + 4)  # a GPT-NeoX layer's 12 tensors
    adapter_ckpt = sum(adapters) * (4 + state) + fingerprint
    return LoraEstimate(
        sdp=sdp,
        adapter_numel=sum(adapters),
        frozen_sharded=0 if quantized else sharded_base * 2,
        frozen_codes=0 if frozen_dtype == "bf16" else math.ceil(sharded_base * FROZEN_BYTES[frozen_dtype]),
        frozen_persistent=sum(one_dim) * (4 + copy + 4),
        adapter_states=(whole + split) * per_adapter,
        gathered=(2 * max(blocks) * c if sdp > 1 else 0),
        checkpoint_adapter_only=adapter_ckpt,
        checkpoint_with_base=adapter_ckpt + shape.num_params * 2,
        checkpoint_full=(shape.num_params + sum(adapters)) * 4,
    )


def format_lora(e: LoraEstimate, frozen_dtype: str) -> str:
    def mib(n: int) -> str:
        return f"{n / MiB:10.1f} MiB"

    lines = [
        f"  LoRA: {e.adapter_numel:,} adapter elements; frozen base {frozen_dtype}, sdp {e.sdp}",
        f"    frozen base shard       {mib(e.frozen_sharded)}   (bf16, / sdp)" if e.frozen_sharded else "",
        f"    frozen base shard       {mib(e.frozen_codes)}   ({frozen_dtype} codes + fp32 scale a 64-value "
        "block, / sdp; stored and gathered, no exact copy)"
        if e.frozen_codes
        else "",
        f"    small frozen tensors    {mib(e.frozen_persistent)}   (whole: fp32 main, compute copy, grad)"
        if e.frozen_persistent
        else "",
        f"    adapters                {mib(e.adapter_states)}   (fp32 main, compute copy, grad, optimizer)",
        f"    model states per rank   {mib(e.model_states)}",
        f"    gathered per use        {mib(e.gathered)}   (current + prefetched block, compute dtype)",
        f"  checkpoint, adapter-only  {mib(e.checkpoint_adapter_only)}   (partial: adapters + optimizer state "
        "+ base fingerprint)",
        f"  ... storing the base      {mib(e.checkpoint_with_base)}",
        f"  full export (fp32)        {mib(e.checkpoint_full)}",
    ]
    return "\n".join(line for line in lines if line)  # the lines of modes not in use are empty


def print_lora(args: argparse.Namespace, shape: ModelShape, setup: Any, world: int) -> int:
    """The CLI's table: at --sdp, or at every sharding degree the world allows."""
    from shardpar.cli.recommend import divisors

    if args.lora_rank is None:
        raise ValueError("--frozen-dtype describes a LoRA fine-tune's frozen base: give --lora-rank R too")
    dtype = args.frozen_dtype or "bf16"
    for sdp in [args.sdp] if args.sdp else divisors(world // setup.tp):
        e = estimate_lora(
            shape, rank=args.lora_rank, sdp=sdp, frozen_dtype=dtype, precision=setup.precision,
            optimizer=setup.optimizer, persistence_threshold=int(args.persistence_threshold),
        )  # fmt: skip
        print(format_lora(e, dtype))
    return 0
