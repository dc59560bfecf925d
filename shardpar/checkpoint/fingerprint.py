"""Adapter-only partial checkpoints: the frozen base is recorded by a fingerprint, not stored (issue 33).

[Note: adapter-only checkpoints]
A parameter that does not train (`requires_grad=False` at wrap time: PEFT's base, a frozen embedding)
never changes, and the user loads it again before every resume -- the model is built, from its
pretrained files, before `resume_from_checkpoint`. Writing it at every save is what makes an FSDP2 LoRA
checkpoint 37 GB for a 131 MB adapter. So a partial checkpoint stores the trained parameters, their
optimizer state, buffers and RNG, and for each frozen parameter only its shape, dtype and the CRC-32
of its values as float32 bytes (checksum.py) in the index:

    "frozen": {"gpt_neox.layers.0.attention.query_key_value.base_layer.weight":
                   {"shape": [96, 32], "dtype": "BF16", "checksums": ["crc32:1c291ca3"]}, ...}

`checksums` has one entry per TP rank (the TP-local tensor's, under the recorded `tp` cut). The values
are hashed as float32, not in the stored dtype: a rank holds a sharded frozen weight in its own dtype
but a persistent one as an fp32 main copy, and a resume with another persistence threshold may hold it
the other way; bf16 -> fp32 is exact, so equal checksums still mean equal values. The CRC is of the
whole tensor, whatever sdp saved it: every rank hashes the piece it would write and the pieces combine
in element order (`checksum.crc32_combine`). A resume hashes the base the user loaded the same way --
under its own topology, so at any sdp or world -- and refuses, on every rank and before loading
anything, a base that differs, naming the first differing tensor. A full checkpoint (partial=False)
keeps every weight; `load_consolidated` of an adapter-only checkpoint yields the trained tensors only.

The hash costs one pass over this rank's shard of the base (its fp32 bytes, CRC-32 at 1.5-2.7 GB/s) and
no collective beyond the gather of reports a save already does: at wrap, and again only after the shard
was written ([Note: fingerprint cache]).

[Note: fingerprint cache]
The base does not change in a run, and hashing it at every save was most of an adapter-only save (GPT-NeoX
168m at sdp 4: 0.16-0.33 s per rank per save, against 0.1-0.4 s for DDP's whole save; docs/performance.md).
So the wrap hashes each rank's pieces of the frozen shards once (`partial.prime_fingerprint`, from
smp.DistributedModel) and a save reuses a piece's CRC while the shard is the same tensor, at the same
address, with the same version counter -- which every in-place op on the shard or a plain view of it
moves: shardpar's own writes (`copy_` at wrap, state-dict and checkpoint loads into the base) -- and
while the model's `ShardedState.writes` stands, which every other write of main values moves: a user's
write through a user parameter (`p.add_()`, `p.data.add_()`, `p.data = `: ShardedTensor writes below
autograd, where the version counter does not move), a torch.distributed.checkpoint load, a state-dict
load. A plain torch optimizer stepping the user parameters moves it at every step, so every save then
hashes the base again. Only pieces in a shard no module parameter views are reused
(FrozenShard.viewed_by_params: at sdp > 1, or computing in another dtype, the parameters view a gathered
or compute copy, so a write through their `.data` never reaches the shard); at sdp 1 in the shard's own
dtype, and for frozen tensors kept whole (sdp_frozen_base_mode int8 / nf4), every save hashes again.
What neither sees is a write that reaches the shard's memory around both (`.data` of shardpar's internal
views such as `sharded_state.main(piece)`, numpy, ctypes): the fingerprint a save records is then that of
the base as of the last write they saw. A resume never reuses a hash: it hashes the base it is given, so a base
that differs from the recorded one is always refused.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from shardpar.checkpoint import checksum
from shardpar.checkpoint import index as ix
from shardpar.checkpoint.pieces import Slot
from shardpar.checkpoint.safetensors_io import CheckpointError, dtype_name
from shardpar.runtime import frozen_exact

# One rank's hashes: fqn -> [[start, length, tp_rank, crc, itemsize], ...] of the pieces it hashed.
RankHashes = dict[str, list[list[int]]]


def entries(slots: Iterable[Slot]) -> dict[str, dict[str, Any]]:
    """The index's "frozen" section without its checksums (shape, dtype, TP cut)."""
    out: dict[str, dict[str, Any]] = {}
    for s in slots:
        if s.frozen:
            entry: dict[str, Any] = {"shape": list(s.cut.full_shape), "dtype": dtype_name(s.view.dtype)}
            tp = ix.cut_entry(s.cut)
            out[s.fqn] = entry if tp is None else {**entry, "tp": tp}
    return out


def _crc(values: torch.Tensor) -> int:
    return frozen_exact.piece_crc(values)  # one hash for a piece, whether taken at wrap, save or resume


# (fqn, start, length, tp_rank) -> (the shard, weakly; its version counter; ShardedState.writes; the
# piece's address; CRC): [Note: fingerprint cache]. The weak reference proves the shard is still the same
# tensor (a model built again has new shards, which miss); a freed one's entries are dropped at the next call.
_Entry = tuple["weakref.ref[torch.Tensor]", int, int, int, int]
_cache: dict[tuple[str, int, int, int], _Entry] = {}


def _root(values: torch.Tensor) -> torch.Tensor:
    return values if values._base is None else values._base  # a view's _base is never itself a view


def _reused_crc(s: Slot) -> int:
    key, root = (s.fqn, s.start, s.length, s.tp_rank), _root(s.view)
    hit, now = _cache.get(key), (root._version, s.writes, s.view.data_ptr())
    if hit is not None and hit[0]() is root and hit[1:4] == now:
        return hit[4]
    crc = _crc(s.value)
    _cache[key] = (weakref.ref(root), *now, crc)
    return crc


def rank_hashes(slots: Iterable[tuple[Slot, bool]], *, reuse: bool = False) -> RankHashes:
    """CRC-32 of each frozen piece this rank covers (`(slot, covers)`: exactly one rank covers each element).

    reuse=True (a save): a private frozen piece's CRC from the cache while its shard is unchanged
    ([Note: fingerprint cache]); False (a resume's check): everything hashed now. A quantized base's piece
    has no exact values left: its checksum was taken from them at wrap or at the load that wrote them
    ([Note: quantized base keeps no exact shard], runtime/frozen_exact.py)."""
    if reuse:
        for key in [k for k, hit in _cache.items() if hit[0]() is None]:
            del _cache[key]
    out: RankHashes = {}
    for s, covers in slots:
        if s.frozen and covers and s.length:
            crc = s.exact_crc  # a quantized piece's, taken from its exact values
            if crc is None:
                crc = _reused_crc(s) if reuse and s.private else _crc(s.value)
            out.setdefault(s.fqn, []).append([s.start, s.length, s.tp_rank, crc, _itemsize(s.view)])
    return out


def _itemsize(values: torch.Tensor) -> int:
    return 4 if values.is_floating_point() else values.element_size()


def combine(reports: Iterable[RankHashes], tp_sizes: Mapping[str, int]) -> dict[str, list[str]]:
    """fqn -> the checksum of each TP rank's whole tensor, from every rank's piece hashes."""
    pieces: dict[tuple[str, int], list[list[int]]] = {}
    for rep in reports:
        for fqn, found in rep.items():
            for start, length, tp_rank, crc, itemsize in found:
                pieces.setdefault((fqn, tp_rank), []).append([start, length, crc, itemsize])
    out: dict[str, list[str]] = {}
    for fqn, size in tp_sizes.items():
        sums = []
        for tp_rank in range(size):
            value, pos = checksum.start(), 0
            for start, length, crc, itemsize in sorted(pieces.get((fqn, tp_rank), [])):
                if start != pos:  # every element hashed once: a gap or an overlap is a bug here, not the user's
                    raise AssertionError(f"frozen {fqn!r}: hashed pieces jump from element {pos} to {start}")
                value = checksum.crc32_combine(value, crc, length * itemsize)
                pos += length
            sums.append(checksum.text(value))
        out[fqn] = sums
    return out


def shape_problems(saved: Mapping[str, Any], slots: Iterable[Slot]) -> list[str]:
    """Frozen entries the model's parameters cannot be compared with (shape, TP cut)."""
    problems = []
    for s in slots:
        entry = saved.get(s.fqn)
        if entry is None:
            continue
        if list(s.cut.full_shape) != entry["shape"]:
            problems.append(
                f"{s.fqn}: full shape {list(s.cut.full_shape)} in the model, {entry['shape']} in the checkpoint"
            )
        elif ix.cut_entry(s.cut) != entry.get("tp"):
            problems.append(
                f"{s.fqn}: frozen, saved (as a fingerprint) under the tensor-parallel cut {entry.get('tp')}, the "
                f"model has {ix.cut_entry(s.cut)}; resume at the saving run's tensor_parallel_degree"
            )
    return problems


def verify(directory: Path, saved: Mapping[str, Any], reports: Iterable[RankHashes]) -> None:
    """Refuse a loaded base whose checksums differ from the saved fingerprint (same outcome on every rank:
    every rank combines the same reports)."""
    loaded = combine(reports, {fqn: len(entry["checksums"]) for fqn, entry in saved.items()})
    differing = [fqn for fqn, entry in saved.items() if loaded.get(fqn) != list(entry["checksums"])]
    if differing:
        first = differing[0]
        raise CheckpointError(
            f"{directory}: the frozen base the model holds is not the one this checkpoint was trained on: "
            f"{len(differing)} of {len(saved)} frozen tensors differ, the first {first!r} (checksum "
            f"{saved[first]['checksums']} in the checkpoint, {loaded.get(first)} loaded). An adapter-only "
            "checkpoint stores the trained parameters and a fingerprint of the frozen ones, not their values: "
            "build the model from the same base weights (same files, dtype and changes) before "
            "resume_from_checkpoint, or save with partial=False to keep every weight"
        )
