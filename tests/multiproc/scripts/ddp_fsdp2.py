"""A plain PyTorch DDP + FSDP2 training script; the only shardpar line is the import that registers
the `smddp` backend. Run under torchrun with `--backend gloo` or `--backend smddp`; rank 0 writes the
final parameters and losses (and, for smddp, which route each collective took) to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import shardpar.collectives.smddp  # noqa: F401  - registers backend "smddp"

STEPS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # Uneven widths: FSDP2 pads shards, DDP's buckets get odd sizes.
    return torch.nn.Sequential(
        torch.nn.Linear(33, 70), torch.nn.GELU(), torch.nn.Linear(70, 17), torch.nn.Linear(17, 5)
    )


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 33, generator=gen), torch.randn(8, 5, generator=gen)


def _train(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[float]:
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, dist.get_rank())
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        losses.append(summed.item() / dist.get_world_size())
    return losses


def run_ddp() -> dict[str, object]:
    model = _model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.004)  # several buckets, one allreduce each
    losses = _train(ddp, list(ddp.parameters()))
    return {"losses": losses, "params": [p.detach().flatten().tolist() for p in model.parameters()]}


def run_fsdp2() -> dict[str, object]:
    model = _model()
    world = dist.get_world_size()
    # HSDP (replicate x shard) from 4 ranks on: the groups of the mesh are smddp groups too.
    shape = (2, world // 2) if world >= 4 else (world,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("rep", "shard")[-len(shape) :])
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses = _train(model, list(model.parameters()))
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
    before = _routes(groups)
    # DTensor's full_tensor() is a functional collective: C++ reaches the group's coalesced gather.
    full = [p.full_tensor().detach().flatten().tolist() for p in model.parameters()]  # type: ignore[attr-defined]
    after = _routes(groups)
    return {
        "losses": losses,
        "params": full,
        "groups": [type(g).__name__ for g in groups],
        "routes": after,
        "full_tensor_routes": {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)},
    }


def _routes(groups: list[object]) -> dict[str, int]:
    """How many calls of each op took each route, over these groups (empty for a plain gloo group)."""
    total: dict[str, int] = {}
    for group in groups:
        for (op, route), n in getattr(group, "routes", {}).items():
            total[f"{op} {route}"] = total.get(f"{op} {route}", 0) + n
    return total


def run_fallbacks() -> dict[str, object]:
    """Collectives the shm path does not serve still work (delegated to gloo) and are counted."""
    rank = dist.get_rank()
    doubles = torch.full((3,), float(rank), dtype=torch.float64)
    dist.all_reduce(doubles)  # float64: not reducible by the transport
    biggest = torch.tensor([float(rank)])
    dist.all_reduce(biggest, op=dist.ReduceOp.MAX)  # not SUM/AVG
    strided = torch.zeros(4, 2)[:, 0]
    strided += rank
    dist.all_reduce(strided)  # not contiguous
    return {"values": [doubles.tolist(), biggest.tolist(), strided.tolist()], "routes": _routes([dist.group.WORLD])}


def run_all() -> dict[str, object]:
    """Everything the script does once the default process group is up (also run by the test on a
    gloo pool, for gloo's reference results without a torchrun of its own)."""
    ddp = run_ddp()
    ddp["routes"] = _routes([dist.group.WORLD])
    return {"ddp": ddp, "fsdp2": run_fsdp2(), "fallbacks": run_fallbacks(), "backend": dist.get_backend()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # A stuck collective becomes an error naming the missing rank well inside the test's own timeout.
    dist.init_process_group(args.backend, timeout=timedelta(seconds=90))
    result = run_all()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
    # Leave without interpreter finalisation. A gloo worker thread that has just finished this
    # script's last collective still has to drop its references to our (Python-owned) tensors, which
    # takes the GIL; if finalisation has begun by then, Python 3.11 ends that thread with
    # pthread_exit inside a noexcept destructor and the process dies of std::terminate ("terminate
    # called without an active exception", SIGABRT) - with plain gloo as with smddp, ~1 run in 5 here.
    # Seen with gdb in torch 2.13: AsyncAllreduceWork::~AsyncAllreduceWork -> take_gil -> abort.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
