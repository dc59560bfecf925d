"""Autograd communication regions of tensor parallelism (Megatron-LM, Shoeybi et al. 2019, section 3).

    region              forward                      backward
    copy_to_tp          identity                     AllReduce(sum) over the TP group
    reduce_from_tp      AllReduce(sum)               identity
    gather_from_tp      AllGather along the last dim  this rank's slice of the grad
    scatter_to_tp       this rank's last-dim slice    AllGather along the last dim

A column-parallel layer reads a replicated input through `copy_to_tp`, so the partial input grads of
the TP ranks are summed and every TP rank hands the same full grad to whatever computed the input
(LayerNorm weights then get identical grads on every TP rank, as TP-replicated parameters must).
A row-parallel layer's partial outputs meet in `reduce_from_tp`.

Every collective goes through the shardpar engine on the TP `Group` (never raw torch.distributed),
so it is counted with the rest and works on any device the engine serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardpar.collectives import Engine, Group


@dataclass(frozen=True)
class TPComm:
    """What a TP layer needs to communicate: the engine, this rank's TP group and its position there."""

    engine: Engine
    group: Group
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.group.size:
            raise AssertionError(f"TP rank {self.rank} outside TP group {self.group.ranks}")

    @property
    def size(self) -> int:
        return self.group.size

    def broadcast_from_first(self, t: torch.Tensor) -> torch.Tensor:
        """TP rank 0's `t` on every TP rank (a collective), where `t` was. It travels on the device the
        engine's collectives use (CUDA for NCCL), since the TP conversion runs on the model as built.
        A group with no process group behind it (one process converting a model to check the layout)
        has nobody to hear from: `t` is returned as it is."""
        if self.size == 1 or self.group.handle is None:
            return t
        wire = t.to(_wire_device()).contiguous()
        self.engine.broadcast(wire, self.group.ranks[0], self.group)
        return wire.to(t.device)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the TP group into a new tensor (autograd may still own `t`)."""
        out = t.contiguous().clone()
        self.engine.all_reduce(out, self.group)
        return out

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Every TP rank's `t`, concatenated along the last dim in TP-rank order."""
        if self.size == 1:
            return t
        t = t.contiguous()
        out = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)
        self.engine.all_gather(out.view(-1), t.view(-1), self.group)
        return torch.cat(out.unbind(0), dim=-1)

    def all_gather_stack(self, t: torch.Tensor) -> torch.Tensor:
        """Every TP rank's `t`, stacked along a new dim 0 in TP-rank order."""
        t = t.contiguous()
        out = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)
        self.engine.all_gather(out.view(-1), t.view(-1), self.group)
        return out

    def slice_last(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous 1/size of the last dim."""
        if t.shape[-1] % self.size:
            raise ValueError(f"last dim {t.shape[-1]} is not divisible by tensor_parallel_degree {self.size}")
        return t.chunk(self.size, dim=-1)[self.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.comm.all_reduce(grad), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm) -> torch.Tensor:
        return comm.all_reduce(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm) -> torch.Tensor:
        ctx.comm = comm
        return comm.all_gather_last(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.comm.slice_last(grad), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm) -> torch.Tensor:
        ctx.comm = comm
        return comm.slice_last(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.comm.all_gather_last(grad), None


def copy_to_tp_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    if comm.size == 1:
        return x
    out: torch.Tensor = _CopyToTP.apply(x, comm)
    return out


def reduce_from_tp_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    if comm.size == 1:
        return x
    out: torch.Tensor = _ReduceFromTP.apply(x, comm)
    return out


def gather_from_tp_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    if comm.size == 1:
        return x
    out: torch.Tensor = _GatherFromTP.apply(x, comm)
    return out


def scatter_to_tp_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    if comm.size == 1:
        return x
    out: torch.Tensor = _ScatterToTP.apply(x, comm)
    return out


def _wire_device() -> torch.device:
    """The device of the engine's collectives: smp.init picks CUDA (NCCL) where there is one."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
