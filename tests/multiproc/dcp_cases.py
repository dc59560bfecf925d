"""Cases for test_dcp.py (issue 32 item 5): torch.distributed.checkpoint both ways between an FSDP2 job
(fully_shard per layer and the root, torch.optim.AdamW) and shardpar at another world size and sdp.

Exactness as in fsdp2_cases.py: both sides get the same full gradients set on `.grad` and step AdamW
element by element, so parameters and Adam state are the same bits whatever the sharding, and every
comparison is `torch.equal` (fsdp2_cases._same)."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import shardpar as smp
from shardpar.runtime.sharded_tensor import ShardedTensor
from tests import models
from tests.multiproc.fsdp2_cases import CONFIG, _adamw, _same

FULL = StateDictOptions(full_state_dict=True)


def _fsdp2(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = models.tiny_neox(seed)
    for layer in model.gpt_neox.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, _adamw(model)


def _shardpar(seed: int, sdp: int, **knobs: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    smp.init({**CONFIG, "sharded_data_parallel_degree": sdp, **knobs})  # no clipping: as FSDP2
    model = smp.DistributedModel(models.tiny_neox(seed))
    return model, smp.DistributedOptimizer(_adamw(model))


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """fsdp2_cases._step for either side: the same full gradient, as a DTensor of the parameter's
    placement under FSDP2 (each rank keeps its own chunk, no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    for _, p in sorted(model.named_parameters()):
        full = torch.randn(p.shape, generator=g)
        p.grad = (
            distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else full
        )
    opt.step()
    opt.zero_grad()


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Full state dicts, copied: torch's hold the live `step` tensors, which the next step counts up."""
    return copy.deepcopy(get_state_dict(model, opt, options=FULL))


def _save(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _load(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> float:
    """DCP load as FSDP2's docs have it; the seconds it took (state dicts, dcp.load, set_state_dict)."""
    dist.barrier()
    t0 = time.perf_counter()
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    dist.barrier()
    return time.perf_counter() - t0


def fsdp2_save_case(path: str) -> dict[str, Any]:
    """FSDP2 trains 2 steps, saves with DCP, takes a third; the full states before and after it."""
    model, opt = _fsdp2(0)
    for seed in (1, 2):
        _step(model, opt, seed)
    out: dict[str, Any] = {"placements": sorted({str(p.placements) for p in model.parameters()})}
    _save(model, opt, path)
    out["saved"] = _full(model, opt)
    _step(model, opt, 3)
    out["next"] = _full(model, opt)
    return out


def shardpar_from_fsdp2_case(
    src: str, dst: str, converted: str, native: str, saved: Any, after: Any, sdp: int, **knobs: Any
) -> dict[str, Any]:
    """A fresh shardpar model (another init) loads FSDP2's checkpoint, takes FSDP2's third step, saves
    with DCP (and as a shardpar checkpoint, `native`), and takes a fourth (what FSDP2 must reproduce
    from our checkpoint). Another fresh one resumes from `converted` (FSDP2's, through shardpar convert)."""
    model, opt = _shardpar(7, sdp, **knobs)
    smp.resume_from_checkpoint(converted)
    out_converted = _same(_full(model, opt), saved)
    model, opt = smp.DistributedModel(models.tiny_neox(7)), None
    opt = smp.DistributedOptimizer(_adamw(model))
    msd, osd = get_state_dict(model, opt)
    out: dict[str, Any] = {
        "converted": out_converted,
        "types": sorted({type(v).__name__ for v in msd.values()}),
        "optim_types": sorted({type(v).__name__ for s in osd["state"].values() for v in s.values()}),
    }
    _load(model, opt, src)
    out["loaded"] = _same(_full(model, opt), saved)
    _step(model, opt, 3)
    out["stepped"] = _same(_full(model, opt), after)
    _save(model, opt, dst)
    smp.save_checkpoint(native, tag="step3", partial=True, model=model, optimizer=opt)
    _step(model, opt, 4)
    out["next"] = _full(model, opt)
    return out


def fsdp2_from_shardpar_case(src: str, converted: str, saved: Any, after: Any) -> dict[str, Any]:
    """FSDP2 (another init) loads shardpar's checkpoint and takes the step shardpar took next; another
    loads `converted` (shardpar's own format through shardpar convert)."""
    model, opt = _fsdp2(8)
    _load(model, opt, converted)
    out = {"converted": _same(_full(model, opt), saved)}
    model, opt = _fsdp2(7)
    _load(model, opt, src)
    out["loaded"] = _same(_full(model, opt), saved)
    _step(model, opt, 4)
    out["stepped"] = _same(_full(model, opt), after)
    return out


def sharded_state_dict_case() -> dict[str, Any]:
    """The sharded state dict aliases the pieces, and set_state_dict takes it back with no gathering."""
    model, opt = _shardpar(0, 2)
    _step(model, opt, 1)
    msd, osd = get_state_dict(model, opt)
    full = _full(model, opt)
    name = "gpt_neox.layers.0.mlp.dense_h_to_4h.weight"
    p = dict(model.named_parameters())[name]
    out: dict[str, Any] = {"alias": msd[name].local_piece.data_ptr() == p.local_piece.data_ptr()}
    out["full_tensor"] = _same(
        {k: v.full_tensor() if isinstance(v, ShardedTensor) else v for k, v in msd.items()}, full[0]
    )
    fresh, fresh_opt = smp.DistributedModel(models.tiny_neox(3)), None
    fresh_opt = smp.DistributedOptimizer(_adamw(fresh))
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)  # same placement: local copies
    out["set"] = _same(_full(fresh, fresh_opt), full)
    try:
        set_state_dict(fresh, fresh_opt, model_state_dict={**msd, "bogus": msd[name]}, optim_state_dict=osd)
        out["unexpected"] = "no error"
    except ValueError as e:
        out["unexpected"] = str(e)
    return out


def persistent_rows_case(path: str) -> dict[str, Any]:
    """sdp 4 with an UnevenMLP whose parameters under 100 elements persist (rows 13, 7, 5 and a scalar:
    blocks of 4-4-4-1, 2-2-2-1, 2-2-1-0, 1-0-0-0): each rank describes its row block of a persistent
    tensor to DCP, `dcp.load` fills exactly those rows, and `set_state_dict` gathers the rest, bit for bit."""
    smp.init({"sharded_data_parallel_degree": 4, "sdp_param_persistence_threshold": 100})
    model, opt = models.adamw_mlp(0)
    models.train_mlp(model, opt, range(2))
    _save(model, opt, path)
    saved = _full(model, opt)
    fresh, fresh_opt = models.adamw_mlp(5)  # another init: every row differs from the saved ones
    msd, osd = get_state_dict(fresh, fresh_opt)
    name = "blocks.0.down.weight"  # [13, 7]: 91 elements, persistent
    out: dict[str, Any] = {"chunks": [(list(c.offsets), list(c.sizes)) for c in msd[name].__create_chunk_list__()]}
    before = msd[name].local_piece.clone()
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    mine = torch.zeros(13, dtype=torch.bool)
    for offsets, sizes in out["chunks"]:
        mine[offsets[0] : offsets[0] + sizes[0]] = True
    after, want = msd[name].local_piece, saved[0][name]
    out["own_rows_loaded"] = torch.equal(after[mine], want[mine])
    stale = torch.equal(after[~mine], before[~mine]) and not torch.equal(before[~mine], want[~mine])
    out["other_rows_untouched"] = stale
    set_state_dict(fresh, fresh_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    out["loaded"] = _same(_full(fresh, fresh_opt), saved)
    models.train_mlp(model, opt, range(2, 3))  # the compute copies refreshed: the next step is the same too
    models.train_mlp(fresh, fresh_opt, range(2, 3))
    out["stepped"] = _same(_full(fresh, fresh_opt), _full(model, opt))
    return out
