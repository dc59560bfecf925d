"""The per-rank memory of one training step, moment by moment, as the runtime allocates it: the
arithmetic behind `shardpar estimate` (estimate.py holds the job description and the command's
helpers; model_shape.py the units).

A step is walked unit by unit -- forward in unit order, then backward in reverse -- and at every
moment the bytes alive are summed; the peak is the largest sum. What is alive follows the runtime:

    always           fp32 main shards; the compute-dtype copy of the shards (mixed precision only);
                     the optimizer state (AdamW: exp_avg + exp_avg_sq, made at the first step and kept);
                     buffers; the framework (interpreter, torch, CUDA context / gloo)
    gathered         at sdp > 1, every unit the scheduler holds unsharded: the root (its forward spans
                     the whole pass), the unit that computes, the next one prefetched while that fits
                     under sdp_max_live_parameters (runtime/schedule.py). At sdp 1 units compute on
                     views of their shard: nothing is gathered
    gather scratch   CPU only: a gather that goes to gloo (above the smddp engine's 16 MiB
                     SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES, or on the native engine) stages through
                     temporaries of at most 2 x 4 MiB ([Note: gloo's gather temporary], native.py)
    activations      what each layer saves for backward (estimate.activation_bytes), kept from its forward
                     to its backward; the logits and the loss's fp32 working set from the LM head's
                     forward to its backward
    unit gradients   a unit's full gradients, from its backward until they reach the reduce bucket
    reduce bucket    units are packed in reverse order into buckets of sdp_reduce_bucket_size elements
                     (runtime/reducer.py). Inside a node at sdp > 1 (smddp) a bucket is read in
                     place: the full gradients of its units stay until the last one arrives. Elsewhere
                     a [sdp, width] buffer is allocated at its first unit and packed as units arrive
                     (the unit's gradients are freed once packed)
    main gradients   the fp32 sharded gradients, one bucket's worth more at every bucket issued.
                     With shard_optimizer_state these are the shard-sized "shard gradients" until the
                     boundary's replication ReduceScatter leaves this rank its piece (the main
                     gradients the optimizer sees): both exist at the end of backward
    optimizer step   all the above states, plus the step's temporaries: torch's per-tensor AdamW (CPU
                     default) two of the largest parameter piece, the foreach one (CUDA default) one
                     copy of every shard

Counted against measurement: tests/unit/test_estimate.py compares the peak with the per-rank VmHWM
of real CPU runs (tests/unit/measured_memory.json, benchmarks/bench_memory.py --calibrate) and with a
live run in the suite. The GPU figure is the same walk without the gloo scratch, with the CUDA
framework term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardpar.runtime.reducer import pack_in_order

GATHER_CHUNK_BYTES = 4 << 20  # collectives/native.py GLOO_GATHER_CHUNK_BYTES
SMDDP_SCRATCH_BYTES = 16 << 20  # the default SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES (reference 003)


@dataclass(frozen=True)
class UnitBytes:
    """One non-root unit as the walk sees it, all in bytes on one rank."""

    kind: str  # "block" (saves activations), "embedding" (before the blocks) or "head" (after them)
    gathered: int  # its gathered buffer (0 at sdp 1)
    scratch: int  # gloo's staging while it is gathered (CPU, above the smddp scratch)
    grads: int  # its full gradients in the bucket's dtype
    shard: int  # its reduced shard in the bucket's dtype (this rank's row of the bucket)
    numel: int  # gathered elements, for the live cap
    persistent_grads: int = 0  # autograd gradients of its persistent parameters, kept to the end


@dataclass(frozen=True)
class StepInputs:
    """Everything the walk needs, in bytes (numel only where the live cap compares elements)."""

    states: int  # always alive: main shards, compute copies, optimizer state, buffers, framework
    main_grads: int  # all fp32 main gradients the optimizer steps, persistent ones included
    root_persistent_grads: int  # the root's persistent parameters' autograd gradients
    persistent_payload: int  # the boundary's AllReduce of the persistent gradients (rdp > 1)
    root_gathered: int
    root_numel: int
    units: tuple[UnitBytes, ...]  # forward order, root excluded
    cap: int  # sdp_max_live_parameters
    bucket_numel: int  # sdp_reduce_bucket_size
    in_place: bool  # the bucket is read in place (smddp inside a node, sdp > 1)
    layer_kept: int  # one block's activations kept for backward
    layer_work: int  # one block's working set while it (re)computes in backward (checkpointing)
    logits: int  # logits + the loss's working set, kept from the head's forward to its backward
    optimizer_temp: int
    # CPU: the part of a layer's saved activations in tensors below glibc's mmap threshold. glibc
    # serves those from its heap and keeps them when they are freed (the heap is fragmented by then),
    # so they stay resident through backward and the optimizer step; bigger tensors are mmapped and
    # go back to the OS when freed.
    layer_retained: int = 0
    # shard_optimizer_state: the shard-sized main grads a backward builds before the replication
    # ReduceScatter (0 without the knob: the backward builds the main gradients themselves)
    shard_grads: int = 0


@dataclass(frozen=True)
class Moment:
    where: str
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def walk(x: StepInputs) -> list[Moment]:
    """Every moment of a step whose bytes may be the peak, in step order."""
    return [*_forward(x), *_backward(x), _optimizer(x)]


def peak(x: StepInputs) -> Moment:
    return max(walk(x), key=lambda m: m.total)


def gathered_at(x: StepInputs, units: list[UnitBytes], i: int) -> tuple[int, int]:
    """(gathered bytes, gather scratch) while units[i] computes and the next one is prefetched."""
    live = x.root_gathered + units[i].gathered
    numel = x.root_numel + units[i].numel
    scratch = units[i].scratch
    if i + 1 < len(units) and numel + units[i + 1].numel <= x.cap:
        live += units[i + 1].gathered
        scratch = max(scratch, units[i + 1].scratch)  # the prefetch stages while this unit computes
    return live, scratch


def _forward(x: StepInputs) -> list[Moment]:
    units = list(x.units)
    kept, out = 0, []
    for i, u in enumerate(units):
        gathered, scratch = gathered_at(x, units, i)
        if u.kind == "block":
            kept += x.layer_kept
        logits = x.logits if u.kind == "head" else 0
        out.append(
            Moment(
                f"forward of unit {i + 1} ({u.kind})",
                {"states": x.states, "gathered": gathered, "gather scratch": scratch, "activations": kept + logits},
            )
        )
    return out


def _buckets(units: list[UnitBytes], size: int) -> list[list[int]]:
    """Unit indices per bucket, as reducer.plan_buckets packs them (reverse order, gradient units)."""
    order = [i for i in reversed(range(len(units))) if units[i].grads]
    return [[order[k] for k in group] for group in pack_in_order([units[i].numel for i in order], size)]


def _backward(x: StepInputs) -> list[Moment]:
    units = list(x.units)
    order = list(reversed(units))  # backward visits units in reverse
    bucket_of = {i: b for b, group in enumerate(_buckets(units, x.bucket_numel)) for i in group}
    kept = sum(x.layer_kept for u in units if u.kind == "block")
    logits = x.logits
    main_grads = held = 0  # issued buckets' shards; the open bucket's gradients or buffer
    built = "shard gradients" if x.shard_grads else "main gradients"  # what the buckets reduce into
    persistent = x.root_persistent_grads  # autograd gradients of persistent parameters, to the end
    current: int | None = None
    out = []
    for j, u in enumerate(order):
        i = len(units) - 1 - j
        gathered, scratch = gathered_at(x, order, j)
        b = bucket_of.get(i)
        if b is not None and b != current:  # a new bucket opens: the previous one was issued
            main_grads += _shard_of_bucket(units, bucket_of, current)
            held, current = 0, b
        if b is not None and not x.in_place:
            held = _buffer_of_bucket(units, bucket_of, b)  # allocated as its first unit arrives
        persistent += u.persistent_grads
        work = x.layer_work if u.kind == "block" else 0
        out.append(
            Moment(
                f"backward of unit {i + 1} ({u.kind})",
                {
                    "states": x.states,
                    built: main_grads,
                    "gathered": gathered,
                    "gather scratch": scratch,
                    "activations": kept + logits + work,
                    "unit gradients": u.grads + persistent,
                    "reduce bucket": held,
                },
            )
        )
        if u.kind == "block":
            kept -= x.layer_kept - x.layer_retained
        if u.kind == "head":
            logits = 0  # the logits are large enough for mmap: returned to the OS when freed
        if b is not None and x.in_place:
            held += u.grads  # read in place: the unit's gradients wait for the rest of its bucket
    # the persistent main gradient is made while their autograd gradients are added into it; then
    # the boundary's AllReduce packs them (with the used-parameter flags) into one payload
    end = {
        "states": x.states,
        "shard gradients": x.shard_grads,  # the ReduceScatter's input, beside its output
        "main gradients": x.main_grads,
        "unit gradients": max(persistent, x.persistent_payload),
    }
    out.append(Moment("end of backward", {**end, "activations": _kept_by_allocator(x)}))
    return out


def _kept_by_allocator(x: StepInputs) -> int:
    """Activation memory freed in backward that the process still holds (CPU: glibc's heap)."""
    return sum(x.layer_retained for u in x.units if u.kind == "block")


def _shard_of_bucket(units: list[UnitBytes], bucket_of: dict[int, int], b: int | None) -> int:
    return 0 if b is None else sum(units[i].shard for i, bb in bucket_of.items() if bb == b)


def _buffer_of_bucket(units: list[UnitBytes], bucket_of: dict[int, int], b: int) -> int:
    # [sdp, width] rows of padded shards: the units' gradients padded, in the bucket's dtype
    return sum(units[i].grads for i, bb in bucket_of.items() if bb == b)


def _optimizer(x: StepInputs) -> Moment:
    return Moment(
        "optimizer step",
        {
            "states": x.states,
            "main gradients": x.main_grads,
            "optimizer temporaries": x.optimizer_temp,
            "activations": _kept_by_allocator(x),
        },
    )


def gather_scratch(gathered_bytes: int, shard_bytes: int, *, cpu: bool, smddp: bool) -> int:
    """gloo's staging for one gather: CPU gathers that do not go through shared memory."""
    if not cpu or gathered_bytes == 0 or (smddp and shard_bytes <= SMDDP_SCRATCH_BYTES):
        return 0
    return min(gathered_bytes, 2 * GATHER_CHUNK_BYTES)


def ceil_to(n: int, k: int) -> int:
    return math.ceil(n / k) * k
