"""Cases for test_owner_compute.py's DCP test: torch.distributed.checkpoint's optimizer state dicts of an
owner-stepped optimizer (torch.optim.Muon for the hidden matrices + AdamW for the rest, one
smp.DistributedOptimizer; shardpar/checkpoint/dcp_owned.py), saved at world 4 and resumed at other
worlds, sdp and shard_optimizer_state -- through dcp.save/dcp.load and through the full state dict.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

import shardpar as smp
from tests.multiproc import checkpoint_cases as ck
from tests.multiproc import owner_cases

FULL = StateDictOptions(full_state_dict=True)


def _full_optim(model: Any, opt: Any) -> dict[str, Any]:
    """The full optimizer state dict, copied (it holds live `step` tensors the next step counts up)."""
    return copy.deepcopy(get_optimizer_state_dict(model, opt, options=FULL))


def save_case(path: str, full_file: str, knobs: dict[str, Any]) -> dict[str, Any]:
    """3 steps, dcp.save of the sharded state dicts (and the full optimizer state dict to `full_file`),
    3 more steps (the straight run)."""
    model, opt = owner_cases._build_ckpt(knobs, 0)
    try:
        owner_cases._train_ckpt(model, opt, range(3))
        at_save, owned, full = ck._full_state(model), owner_cases.owned_state(opt), _full_optim(model, opt)
        msd, osd = get_state_dict(model, opt)
        held = sorted(osd["state"])  # the keys this rank's sharded optimizer state dict holds
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        if smp.rank() == 0:
            torch.save(full, full_file)
        losses = owner_cases._train_ckpt(model, opt, range(3, 6))
        return {
            "at_save": at_save,
            "owned": owned,
            "full": full,
            "held": held,
            "owned_here": sorted(f for f, _, mine in opt.owned_leaves() if mine),
            "owner_stepped": sorted(f for f, _, _ in opt.owned_leaves()),
            "losses": losses,
            "final": ck._full_state(model),
        }
    finally:
        smp.shutdown()


def resume_case(path: str, full_file: str, knobs: dict[str, Any], form: str) -> dict[str, Any]:
    """Another seed under `knobs`; the model through DCP; the optimizer through DCP (`form` "dcp") or the
    full state dict every rank reads from `full_file` ("full"); then steps 3..5."""
    model, opt = owner_cases._build_ckpt(knobs, 123)
    try:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        if form == "dcp":
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, opt, torch.load(full_file, weights_only=False))
        resumed, owned, full = ck._full_state(model), owner_cases.owned_state(opt), _full_optim(model, opt)
        losses = owner_cases._train_ckpt(model, opt, range(3, 6))
        return {"resumed": resumed, "owned": owned, "full": full, "losses": losses, "final": ck._full_state(model)}
    finally:
        smp.shutdown()
