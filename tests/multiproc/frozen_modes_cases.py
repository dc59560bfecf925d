"""Cases for test_frozen_modes.py: `sdp_frozen_base_mode` (issue 33 item 2) on tiny GPT-NeoX + PEFT LoRA
with a bf16 base under bf16, sdp 2: the bytes each frozen gather moves, and a LoRA fine-tune per mode."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

import shardpar as smp
from shardpar.runtime import frozen_quant

# The adapters (r 8: at most 96 x 8) stay whole on every rank; every base weight above it is sharded.
KNOBS = {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 1000, "bf16": True}
TARGETS = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]


def neox_lora(rank: int = 8, base_seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    from tests import models

    module = models.tiny_neox(base_seed).to(dtype)
    torch.manual_seed(1)  # lora_A's draws
    return get_peft_model(module, LoraConfig(r=rank, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.summary = ""

    def handle(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("shardpar is active"):
            self.summary = record.getMessage()  # the wrap summary (api/summary.py)
        return super().handle(record)

    def emit(self, record: logging.LogRecord) -> None:
        if "sdp_frozen_base_mode" in record.getMessage() or "nothing is sharded" in record.getMessage():
            self.lines.append(record.getMessage())


def bytes_case(mode: str, micro: int = 2, cap: int | None = None, threshold: int = 1000) -> dict[str, Any]:
    """One warm-up step, then one step of `micro` micro-batches: every AllGather over the sharding group
    of the measured step ((dtype, bytes), in order), the losses, the log lines, and for each unit with
    a frozen shard what one gather of it moves under each mode. `threshold` 100 shards the adapters too:
    units of trainable and frozen parameters."""
    log, capture = logging.getLogger("shardpar"), _Capture()
    log.addHandler(capture)
    log.setLevel(logging.INFO)
    knobs = {**KNOBS, "sdp_frozen_base_mode": mode, "sdp_param_persistence_threshold": threshold}
    knobs |= {} if cap is None else {"sdp_max_live_parameters": cap}
    try:
        smp.init(knobs)
        model = smp.DistributedModel(neox_lora(), backward_passes_per_step=micro)
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        at_wrap = sum(u.frozen.shard.untyped_storage().nbytes() for u in model.units if u.frozen is not None)
        stats = smp.comm_stats()
        g = torch.Generator().manual_seed(smp.rank())
        losses = []
        for _ in range(2):
            stats.begin_step()
            for _ in range(micro):
                ids = torch.randint(0, 96, (2, 16), generator=g)
                loss = model(input_ids=ids, labels=ids).loss
                model.backward(loss / micro)
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        gathers = [(str(r.dtype), r.bytes) for r in stats.history[-1] if r.op == "all_gather" and r.group == "sharding"]
        sdp = 2
        per_unit = {
            u.name: {
                "bf16": u.frozen.padded_numel * 2,
                "int8": sdp * frozen_quant.packed_bytes("int8", u.frozen.layout.shard_numel),
                "nf4": sdp * frozen_quant.packed_bytes("nf4", u.frozen.layout.shard_numel),
                "numel": u.frozen.padded_numel,
            }
            for u in model.units
            if u.frozen is not None
        }
        trainable_gathered = sum(u.layout.padded_numel for u in model.units)
        kept_after_step = sum(
            u.frozen._gathered.untyped_storage().nbytes()
            for u in model.units
            if u.frozen is not None and u.frozen._gathered is not None
        )
        live_after_step, live_peak = model.live.live, model.live.peak
        # what a rank stores of each frozen shard between uses: int8 / nf4 keep the codes only
        frozen = [u.frozen for u in model.units if u.frozen is not None]
        stored = {u.name: u.frozen.stored_bytes for u in model.units if u.frozen is not None}
        storage = [
            (f.shard.untyped_storage().nbytes(), f._packed.numel() if f._packed is not None else 0) for f in frozen
        ]
        # the state dict's base: the exact one, or under int8 / nf4 the dequantized one (warned once)
        fresh = {k: v for k, v in neox_lora().state_dict().items() if "lora_" not in k}
        lines_before_read = len(capture.lines)
        saved = model.state_dict()
        model.state_dict()  # a second read: no second warning
        base_diff = max((saved[k].float() - v.float()).abs().max().item() for k, v in fresh.items())
        base_rel = max(
            ((saved[k].float() - v.float()).abs().max() / v.float().abs().max()).item()
            for k, v in fresh.items()
            if v.float().abs().max() > 0
        )
        stored_after_read = {u.name: u.frozen.stored_bytes for u in model.units if u.frozen is not None}
        modes = sorted({u.frozen.mode for u in model.units if u.frozen is not None})
    finally:
        smp.shutdown()
        log.removeHandler(capture)
    return {
        "gathers": gathers,
        "losses": losses,
        "per_unit": per_unit,
        "trainable_gathered": trainable_gathered,
        "kept_after_step": kept_after_step,
        "modes": modes,
        "live_after_step": live_after_step,
        "live_peak": live_peak,
        "base_diff": base_diff,
        "base_rel": base_rel,
        "at_wrap": at_wrap,
        "lines_before_read": lines_before_read,
        "stored": stored,
        "storage": storage,
        "stored_after_read": stored_after_read,
        "log": capture.lines,
        "summary": capture.summary,
    }


def finetune_case(modes: list[str], steps: int = 30, lr: float = 2e-3, fp32: bool = False) -> dict[str, list[float]]:
    """PEFT LoRA r 8 on the attention and MLP linears, world 2 x sdp 2, AdamW, `steps` steps on a fixed
    set of 8 sequences (2 a rank a step, cycling): the global mean loss of each step under each mode;
    "int8@1" is int8 at sdp 1 (2 replicas). `fp32`: an fp32 base, trained in fp32."""
    out: dict[str, list[float]] = {}
    data = torch.randint(0, 96, (8, 24), generator=torch.Generator().manual_seed(7))
    for name in modes:
        mode, _, sdp = name.partition("@")
        knobs = {**KNOBS, "bf16": not fp32, "sdp_frozen_base_mode": mode, "sharded_data_parallel_degree": int(sdp or 2)}
        smp.init(knobs)
        model = smp.DistributedModel(neox_lora(dtype=torch.float32 if fp32 else torch.bfloat16))
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=lr))
        losses = []
        for step in range(steps):
            start = (4 * step + 2 * smp.rank()) % 8
            ids = data[start : start + 2]
            loss = model(input_ids=ids, labels=ids).loss
            model.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(sum(smp.allgather(loss.item(), smp.CommGroup.RDP_GROUP)) / 2)
        smp.shutdown()
        out[name] = losses
    return out


def resume_case(root: str, mode: str) -> dict[str, Any]:
    """Under `mode`, a trained model's loss on a fixed batch; then the same after its full checkpoint, or
    its full state dict, is loaded into a model built from another base (its adapter-only partial
    checkpoint is refused there): the loaded base must be what
    is gathered (int8 / nf4: its codes made again from the loaded shard, not the old base's)."""
    ids = torch.arange(32).view(2, 16) % 96
    knobs = {**KNOBS, "sdp_frozen_base_mode": mode}

    def probe(model: Any) -> float:
        with torch.no_grad():
            return float(model(input_ids=ids, labels=ids).loss.item())

    smp.init(knobs)
    model = smp.DistributedModel(neox_lora())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    model.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    opt.zero_grad()
    trained = probe(model)
    smp.save_checkpoint(root, tag="t", model=model, optimizer=opt)  # adapter-only: the base by fingerprint
    smp.save_checkpoint(root, tag="full", model=model, partial=False)  # every weight
    state = {k: v.clone() for k, v in model.state_dict().items()}
    smp.shutdown()
    out: dict[str, Any] = {"trained": trained}
    for how in ("checkpoint", "state_dict"):
        smp.init(knobs)
        model = smp.DistributedModel(neox_lora(base_seed=5))
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        out[f"other_base_{how}"] = probe(model)
        if how == "checkpoint":
            try:  # issue 33 item 3: a partial checkpoint does not replace the base; another base is refused
                smp.resume_from_checkpoint(root, tag="t")
                out["partial_refused"] = ""
            except smp.CheckpointError as e:
                out["partial_refused"] = str(e)
            smp.resume_from_checkpoint(root, tag="full", partial=False)
        else:
            model.load_state_dict(state)
        out[how] = probe(model)
        smp.shutdown()
    return out
