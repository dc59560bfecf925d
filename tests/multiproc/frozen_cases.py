"""Cases for test_frozen.py: PEFT LoRA models, whose units hold frozen base weights (issue 33).

`lora_rss_case` is test_memory.py's measurement (memory_cases.py: VmHWM from outside, with
MALLOC_MMAP_THRESHOLD_ applied) on WideNet under LoRA: every block's base weights are frozen and its
adapters are persistent (below the persistence threshold), so every block unit holds frozen parameters
only. Before issue 33 each stayed gathered from its backward to the end of backward: all six blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import shardpar as smp
from tests.multiproc import memory_cases as mem

# Below it: the adapters (4 x 2048), biases and the root's small layers stay whole on every rank;
# above it: the blocks' base weights (2048 x 2048) are sharded.
PERSISTENCE = 100_000


def lora(module: nn.Module, targets: list[str]) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)  # lora_A's init draws; lora_B starts at zero
    return get_peft_model(module, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))


def adapters(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if "lora_" in k}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise AssertionError(f"state dicts differ in keys: {sorted(a.keys() ^ b.keys())[:4]}")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _wide_lora(checkpoint: bool | None) -> nn.Module:
    torch.manual_seed(0)
    # A reentrant checkpoint needs an input that requires grad (else no grads at all, torch warns): an
    # adapter on `inp` gives the blocks one. Otherwise block 0's input does not: the case of a unit
    # whose backward ends with its adapters' grads alone.
    return lora(mem.WideNet(checkpoint), ["up", "down"] + (["inp"] if checkpoint else []))


def lora_rss_case(checkpoint: bool | None, *, steps: int = 2, lr: float = 0.05) -> dict[str, Any]:
    """WideNet + LoRA at sdp 2, sdp_max_live_parameters = one block: per step the RSS peak of backward
    counted from the step's start, the runtime's live peak; then single-process PEFT on the global batch."""
    mem._apply_mmap_threshold()
    world = 2
    module = _wide_lora(checkpoint)
    # A block's sharded (frozen) elements: its two weights and, since only trained parameters persist,
    # its biases. The root's frozen tensors (inp, head, however small) are sharded too, and the root
    # stays gathered through the step: the cap is one block beside it (+ padding to sdp per unit).
    frozen = [(n, p.numel()) for n, p in module.named_parameters() if not p.requires_grad]
    block = sum(k for n, k in frozen if ".blocks.0." in n)
    root = sum(k for n, k in frozen if ".blocks." not in n)
    cap = block + root + 2 * world
    smp.init(
        {
            "sharded_data_parallel_degree": 2,
            "sdp_param_persistence_threshold": PERSISTENCE,
            "sdp_max_live_parameters": cap,
            "sdp_gradient_clipping": 0.0,
        }
    )
    rank = smp.rank()
    model = smp.DistributedModel(module)
    model.set_live_trace(True)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr))
    backward_peaks, losses, freed_in_backward = [], [], []
    for step in range(steps):
        batch = {
            k: v[rank * mem.ROWS : (rank + 1) * mem.ROWS] for k, v in mem.wide_batch(step, mem.ROWS * world).items()
        }
        phase = mem.Phase()
        loss = model(**batch)
        mark = len(model.live.trace or [])
        model.backward(loss)
        backward_peaks.append(phase.end()["peak"])
        trace = (model.live.trace or [])[mark:]
        # block units freed while backward still had blocks to gather (not all at its end)
        freed_in_backward.append(_freed_before_last_gather(trace))
        opt.step()
        opt.zero_grad()
        losses.append(sum(smp.allgather(loss.item(), smp.CommGroup.RDP_GROUP)) / world)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    max_live = model.live.peak
    smp.shutdown()
    del model, opt

    ref = _wide_lora(checkpoint)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=lr)
    ref_losses = []
    for step in range(steps):
        loss = ref(**mem.wide_batch(step, mem.ROWS * world))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    ref_state = ref.state_dict()
    return {
        "block_bytes": block * 4,
        "block": block,
        "cap": cap,
        "max_live": max_live,
        "backward_peaks": backward_peaks,
        "freed_in_backward": freed_in_backward,
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "adapter_diff": max_diff(adapters(state), adapters(ref_state)),
        "param_diff": max_diff(state, ref_state),
    }


def _freed_before_last_gather(trace: list[tuple[str, int, int]]) -> int:
    gathers = [i for i, (_, delta, _) in enumerate(trace) if delta > 0]
    if not gathers:
        return 0
    return sum(1 for i, (_, delta, _) in enumerate(trace) if delta < 0 and i < gathers[-1])


def _neox_lora(bf16_base: bool) -> nn.Module:
    from tests import models

    module = models.tiny_neox()
    if bf16_base:
        module = module.to(torch.bfloat16)
    return lora(module, ["query_key_value", "dense_4h_to_h"])  # PEFT keeps the adapters in fp32


def frozen_state_case(root: str, save: dict[str, Any], sdp: int) -> dict[str, Any]:
    """Item 1 on tiny GPT-NeoX + LoRA with a bf16 base under bf16 (layers' weights sharded, adapters
    persistent), trained under the knobs `save`: what each unit keeps for its frozen weights and what
    the reducer and the optimizer see after AdamW steps; a partial checkpoint resumed at `sdp` and a
    full state dict against the base; a requires_grad flipped after wrapping."""
    knobs = {"sdp_param_persistence_threshold": 1000, "bf16": True}
    smp.init({**knobs, **save})
    model = smp.DistributedModel(_neox_lora(bf16_base=True))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    # every frozen tensor, however small (biases, layer norms): only trained parameters persist
    frozen_numel = sum(p.numel() for p in _neox_lora(bf16_base=True).parameters() if not p.requires_grad)
    units = model.units
    g = torch.Generator().manual_seed(smp.rank())
    for _ in range(2):
        ids = torch.randint(0, 96, (2, 16), generator=g)
        model.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    frozen = [u.frozen for u in units if u.frozen is not None]
    out: dict[str, Any] = {
        "frozen_dtypes": sorted({str(f.shard.dtype) for f in frozen}),
        "frozen_shard_numel": sum(f.shard.numel() for f in frozen),
        "frozen_numel": frozen_numel,
        "main_numel": sum(u.main_shard.numel() for u in units),
        "main_grad_numel": sum(0 if u.main_grad is None else u.main_grad.numel() for u in units),
        "bucket_units": [u.name for plan in model.reducer.plans for u in plan.units],
        "optimizer_state_params": len(opt.optimizer.state),
        "trainable_params": sum(1 for p in model.parameters() if p.requires_grad),
    }
    ckpt_dir = str(Path(root) / "ckpt")
    smp.save_checkpoint(ckpt_dir, tag="t", model=model, optimizer=opt)
    saved = {k: v.float().clone() for k, v in model.state_dict().items()}
    smp.shutdown()
    base = {k: v.float() for k, v in _neox_lora(bf16_base=True).state_dict().items() if "lora_" not in k}

    smp.init({"sharded_data_parallel_degree": sdp, **knobs})
    model = smp.DistributedModel(_neox_lora(bf16_base=True))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    smp.resume_from_checkpoint(ckpt_dir, tag="t")
    resumed = {k: v.float().clone() for k, v in model.state_dict().items()}
    out["resume_diff"] = max_diff(saved, resumed)
    out["base_diff"] = max_diff({k: v for k, v in resumed.items() if "lora_" not in k}, base)
    weight = next(p for p in model.parameters() if not p.requires_grad and p.dim() == 2)
    weight.requires_grad_(True)
    try:
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    return out
