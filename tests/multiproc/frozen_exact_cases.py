"""Cases for test_frozen_modes.py's fingerprint test: int8 / nf4 keep no exact base ([Note: quantized base
keeps no exact shard], runtime/frozen_exact.py), yet an adapter-only checkpoint records the base the user
loaded and a resume verifies it. Tiny GPT-NeoX + PEFT LoRA, bf16 base, world 2 x sdp 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import shardpar as smp
from tests.multiproc.frozen_modes_cases import KNOBS, neox_lora

IDS = torch.arange(32).view(2, 16) % 96


def _wrap(mode: str, base_seed: int = 0) -> tuple[Any, Any]:
    smp.init({**KNOBS, "sdp_frozen_base_mode": mode})
    model = smp.DistributedModel(neox_lora(base_seed=base_seed))
    return model, smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))


def _probe(model: Any) -> float:
    with torch.no_grad():
        return float(model(input_ids=IDS, labels=IDS).loss.item())


def _checksums(root: Path, tag: str) -> dict[str, list[str]]:
    index = json.loads((root / f"{tag}_partial" / "index.json").read_text())
    return {fqn: entry["checksums"] for fqn, entry in index["frozen"].items()}


def _resume(root: Path, tag: str) -> str:
    try:
        smp.resume_from_checkpoint(str(root), tag=tag)
        return ""
    except smp.CheckpointError as e:
        return str(e)


def fingerprint_case(root: str, mode: str) -> dict[str, Any]:
    """A "gather" run and a `mode` run of the same base save adapter-only checkpoints; the `mode` run's
    after a step and after loading its own (dequantized) state dict back. Then a `mode` model of the same
    base resumes each, and one of another base is refused."""
    out: dict[str, Any] = {}
    path = Path(root)
    model, opt = _wrap("gather")
    smp.save_checkpoint(root, tag="g", model=model, optimizer=opt)
    smp.shutdown()

    model, opt = _wrap(mode)
    model.backward(model(input_ids=IDS, labels=IDS).loss)
    opt.step()
    opt.zero_grad()
    out["trained"] = _probe(model)
    smp.save_checkpoint(root, tag="q", model=model, optimizer=opt)
    # neither training nor an adapter-only save gave the exact shard's storage back
    out["held"] = sum(u.frozen.shard.untyped_storage().nbytes() for u in model.units if u.frozen is not None)
    # the dequantized state dict loaded back: equal to what the shard dequantizes to, so the same codes
    # and the same checksums (of the loaded exact base), not checksums of the dequantized values
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    out["reloaded"] = _probe(model)
    smp.save_checkpoint(root, tag="q2", model=model, optimizer=opt)
    smp.shutdown()

    model, opt = _wrap(mode)  # the same base, loaded again and quantized again
    out["resume_q"] = _resume(path, "q")
    out["resumed"] = _probe(model)
    out["resume_g"] = _resume(path, "g")  # saved under "gather": the same exact base
    smp.shutdown()

    model, opt = _wrap(mode, base_seed=5)
    out["other_base"] = _resume(path, "q")
    smp.shutdown()
    out["sums"] = {tag: _checksums(path, tag) for tag in ("g", "q", "q2")}
    return out
