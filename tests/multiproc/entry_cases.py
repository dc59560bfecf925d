"""Collectives called on some ranks only ([Note: collective entry]): run on every rank by the pool."""

from __future__ import annotations

import os

import shardpar as smp
from shardpar.collectives.entry import CollectiveEntryError
from tests import models


def rank0_only_gathers(directory: str) -> dict[str, str]:
    """A wrapped GPT-NeoX at sdp 2 x tp 2: save_pretrained on every rank works; on rank 0 alone, followed
    by smp.barrier() on every rank, every rank raises at once naming both calls; a model.state_dict() on
    rank 0 alone (the others moving on) raises on rank 0 after collective_entry_timeout_s."""
    out: dict[str, str] = {}
    knobs = {"sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2, "prescaled_batch": True}
    smp.init({**knobs, "collective_entry_timeout_s": 2.0})
    try:
        model = smp.DistributedModel(models.tiny_neox(), tensor_parallelism=True)
        model.save_pretrained(os.path.join(directory, "every_rank"))
        smp.barrier()
        out["every_rank"] = ",".join(sorted(os.listdir(os.path.join(directory, "every_rank"))))
        # transformers' own SMP branch: the state dict gathered on every rank, save_pretrained on rank 0
        state_dict = model.state_dict()
        if smp.rank() == 0:
            model.save_pretrained(os.path.join(directory, "given_state_dict"), state_dict=state_dict)
        smp.barrier()
        out["given_state_dict"] = ",".join(sorted(os.listdir(os.path.join(directory, "given_state_dict"))))
        try:
            if smp.rank() == 0:
                model.save_pretrained(os.path.join(directory, "rank0_only"))
            smp.barrier()
            out["rank0_save"] = "no error"
        except CollectiveEntryError as e:
            out["rank0_save"] = str(e)
    finally:
        smp.shutdown()
    smp.init({**knobs, "collective_entry_timeout_s": 1.0})
    try:
        model = smp.DistributedModel(models.tiny_neox(), tensor_parallelism=True)
        try:
            out["rank0_state_dict"] = str(len(model.state_dict())) if smp.rank() == 0 else "not called"
        except CollectiveEntryError as e:
            out["rank0_state_dict"] = str(e)
    finally:
        smp.shutdown()
    return out
