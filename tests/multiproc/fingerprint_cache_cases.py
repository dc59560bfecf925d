"""Cases for test_adapter_checkpoint.py's fingerprint-cache test ([Note: fingerprint cache] in
checkpoint/fingerprint.py): a save reuses the frozen base's CRCs hashed at wrap, records what hashing the
base afresh records, hashes again what was written, and a resume never reuses a hash."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import shardpar as smp
from shardpar.checkpoint import fingerprint
from tests.multiproc.adapter_ckpt_cases import CHANGED, _step, _wrap

OTHER = "base_model.model.gpt_neox.layers.0.attention.query_key_value.base_layer.weight"


def _frozen(ckpt: Path, tag: str) -> dict[str, list[str]]:
    index = json.loads((ckpt / f"{tag}_partial" / "index.json").read_text())
    return {fqn: e["checksums"] for fqn, e in index["frozen"].items()}


def _save(ckpt: Path, tag: str, model: Any, opt: Any, hashed: list[int]) -> tuple[int, dict[str, list[str]]]:
    """Save; the number of elements this rank hashed (all ranks), and the index's fingerprint."""
    before = sum(hashed)
    smp.save_checkpoint(str(ckpt), tag=tag, model=model, optimizer=opt)
    counts = smp.allgather(sum(hashed) - before, smp.CommGroup.WORLD)
    return sum(counts), _frozen(ckpt, tag)


def fingerprint_cache_case(root: str) -> dict[str, Any]:
    ckpt, out = Path(root) / "ckpt", {}
    hashed: list[int] = []
    crc = fingerprint._crc

    def counted(values: torch.Tensor) -> int:
        hashed.append(values.numel())
        return crc(values)

    fingerprint._crc = counted  # type: ignore[assignment]
    try:
        model, opt = _wrap(2)
        out["at_wrap"] = sum(smp.allgather(sum(hashed), smp.CommGroup.WORLD))
        out["frozen_numel"] = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        for step in range(2):
            _step(model, opt, step)
        out["reused"] = _save(ckpt, "a", model, opt, hashed)
        fingerprint._cache.clear()  # the same base hashed afresh: the same fingerprint
        out["fresh"] = _save(ckpt, "b", model, opt, hashed)
        # the base written after wrap, as a user loading other base weights into the wrapped model does
        weight = model.state_dict()[CHANGED].clone()
        weight[0, 0] += 1
        model.load_state_dict({CHANGED: weight}, strict=False)
        out["written"] = _save(ckpt, "c", model, opt, hashed)
        fingerprint._cache.clear()
        out["written_fresh"] = _save(ckpt, "d", model, opt, hashed)
        # a write through the user parameter's .data (ShardedTensor: below autograd, no version bump)
        with torch.no_grad():
            dict(model.named_parameters())[OTHER].data.add_(1)
        out["user_write"] = _save(ckpt, "e", model, opt, hashed)
        fingerprint._cache.clear()
        out["user_write_fresh"] = _save(ckpt, "f", model, opt, hashed)
        # a resume hashes the base it is given: poisoned cache entries change nothing
        for key, entry in list(fingerprint._cache.items()):
            fingerprint._cache[key] = (*entry[:-1], entry[-1] ^ 1)
        try:
            smp.resume_from_checkpoint(str(ckpt), tag="f")
            out["resume"] = "ok"
        except smp.CheckpointError as e:
            out["resume"] = str(e)
        try:
            smp.resume_from_checkpoint(str(ckpt), tag="a")  # the base before both writes: refused
            out["resume_old"] = "ok"
        except smp.CheckpointError as e:
            out["resume_old"] = str(e)
    finally:
        fingerprint._crc = crc  # type: ignore[assignment]
        fingerprint._cache.clear()
    return out
