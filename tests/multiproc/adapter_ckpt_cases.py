"""Cases for test_adapter_checkpoint.py (issue 33 item 3): adapter-only partial checkpoints of a PEFT LoRA
model with a bf16 base, and its adapter saved in PEFT's format by the wrapped module's `save_pretrained`.

The model is GPT-NeoX with a 32768-token vocabulary (tests/models.neox_wide_vocab): its embedding and
LM head (2 x 2**20 bf16 values, 4 MiB) are units of their own and dwarf the adapters, so a checkpoint
that still stored the base could not pass the size bound.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

import shardpar as smp
from shardpar.api.summary import summarize
from shardpar.checkpoint.convert import read_shardpar
from tests import models
from tests.multiproc.frozen_cases import lora

KNOBS = {"sdp_param_persistence_threshold": 1000, "bf16": True}
TARGETS = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]  # attention and MLP linears
ROWS = 2  # sequences per rank
CHANGED = "base_model.model.gpt_neox.layers.1.mlp.dense_4h_to_h.base_layer.weight"


def lora_model(change_base: bool = False) -> nn.Module:
    module = models.neox_wide_vocab(0).to(torch.bfloat16)
    if change_base:  # one element of one frozen weight: a base the checkpoint was not trained on
        with torch.no_grad():
            module.gpt_neox.layers[1].mlp.dense_4h_to_h.weight[0, 0] += 1
    return lora(module, TARGETS)


def _wrap(sdp: int, change_base: bool = False) -> tuple[Any, Any]:
    smp.init({"sharded_data_parallel_degree": sdp, **KNOBS})
    model = smp.DistributedModel(lora_model(change_base))
    return model, smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))


def _step(model: Any, opt: Any, step: int) -> float:
    ids = models.wide_vocab_batch(step, ROWS * smp.size())["input_ids"]
    mine = ids[smp.rank() * ROWS : (smp.rank() + 1) * ROWS]
    loss = model(input_ids=mine, labels=mine).loss
    model.backward(loss)
    opt.step()
    opt.zero_grad()
    return float(sum(smp.allgather(loss.item(), smp.CommGroup.WORLD)))


def _full_state(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    """Every parameter at full size in fp32, and the optimizer state of the trainable ones."""
    out = {k: v.float().clone() for k, v in model.state_dict().items()}
    for k, v in opt.state_dict()["state"].items():  # the optimizer's view, keyed alike on every topology
        for name, t in v.items():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                out[f"optim/{name}/{k}"] = torch.as_tensor(t).float().clone()
    return out


def _adapters(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().clone() for n, p in model.named_parameters() if p.requires_grad}


def _gathered_bytes_while(fn: Any) -> int:
    stats = smp.comm_stats()
    mark = len(stats.current)
    fn()
    return sum(r.bytes for r in stats.current[mark:] if r.op == "all_gather")


def adapter_checkpoint_case(root: str, sdp_save: int, sdp_resume: int) -> dict[str, Any]:
    """Train 2 AdamW steps at `sdp_save`, save a partial checkpoint, take one more step; resume the
    checkpoint at `sdp_resume` into a model built from the same base and take the same step; then a
    changed base is refused. The first model's `save_pretrained` writes PEFT's adapter."""
    out: dict[str, Any] = {}
    ckpt = Path(root) / "ckpt"
    model, opt = _wrap(sdp_save)
    summary = summarize(model, "-")  # the frozen base counts as sharded: no "nothing is sharded" warning
    # every frozen tensor, however small: only trained parameters persist (the adapters are all trained)
    big = sum(1 for p in lora_model().parameters() if not p.requires_grad)
    out["summary"] = (summary.sharded_tensors, big, summary.nothing_sharded)
    for step in range(2):
        _step(model, opt, step)
    smp.save_checkpoint(str(ckpt), tag="t", model=model, optimizer=opt)
    saved = _full_state(model, opt)
    out["straight_loss"] = _step(model, opt, 2)
    straight = _adapters(model)
    peft_dir = Path(root) / "peft"  # saved at sdp 2, where the base is sharded and a full state dict gathers it
    out["save_pretrained_gathered"] = _gathered_bytes_while(lambda: model.save_pretrained(str(peft_dir)))
    if smp.rank() == 0:
        out["peft_files"] = sorted(p.name for p in peft_dir.iterdir())
        out["peft_diff"] = _peft_round_trip(peft_dir, straight)
    trainable = [p for p in model.parameters() if p.requires_grad]
    out["trainable_bytes"] = sum(p.numel() for p in trainable) * 4  # fp32 values, as saved
    out["frozen_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    out["num_frozen"] = sum(1 for p in model.parameters() if not p.requires_grad)
    smp.shutdown()

    model, opt = _wrap(sdp_resume)
    smp.resume_from_checkpoint(str(ckpt), tag="t")
    resumed = _full_state(model, opt)
    assert saved.keys() == resumed.keys(), sorted(saved.keys() ^ resumed.keys())[:4]
    out["resume_diff"] = max((saved[k] - resumed[k]).abs().max().item() for k in saved)
    out["optimizer_tensors"] = sum(1 for k in saved if k.startswith("optim/"))
    out["resumed_loss"] = _step(model, opt, 2)
    after = _adapters(model)
    out["step_diff"] = max((straight[k] - after[k]).abs().max().item() for k in straight)
    smp.shutdown()

    model, opt = _wrap(sdp_resume, change_base=True)
    try:
        smp.resume_from_checkpoint(str(ckpt), tag="t")
        out["refused"] = None
    except smp.CheckpointError as e:
        out["refused"] = str(e)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]  # zero at init, non-zero when trained
    out["untouched"] = all(p.full_tensor().abs().max().item() == 0 for p in lora_b)
    if smp.rank() == 0:
        try:  # `shardpar convert` of it would be a model without its base: refused
            read_shardpar(ckpt)
            out["convert_refused"] = ""
        except smp.CheckpointError as e:
            out["convert_refused"] = str(e)
        out["files"] = {p.name: p.stat().st_size for p in (ckpt / "t_partial").iterdir()}
        out["index"] = json.loads((ckpt / "t_partial" / "index.json").read_text())
    return out


def _peft_round_trip(directory: Path, adapters: dict[str, torch.Tensor]) -> float:
    """PEFT's own loader on a fresh base: its adapter weights against the trained ones (rank 0)."""
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(models.neox_wide_vocab(0).to(torch.bfloat16), directory)
    mine = dict(loaded.named_parameters())
    assert adapters.keys() <= mine.keys(), sorted(adapters.keys() - mine.keys())[:3]
    return max((mine[k].float() - v.float()).abs().max().item() for k, v in adapters.items())
