"""Persistent parameters: too small to shard (numel < sdp_param_persistence_threshold), replicated on
every rank, gradients AllReduced over the rdp group once per accumulation boundary.

Like a unit they keep an fp32 main copy and an fp32 main grad; in mixed precision the module sees a
compute-dtype copy refreshed after each step. In fp32 the module's parameters *are* views of the
main copy, so nothing is copied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from shardpar.collectives import Engine, Group, ReduceOp
from shardpar.runtime.unit import set_param_data


class PersistentParams:
    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        *,
        engine: Engine,
        rdp: Group,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        device: torch.device,
        materialize: Callable[[nn.Parameter], torch.Tensor],
    ) -> None:
        self.named = named
        self.params = [p for _, p in named]
        self.engine = engine
        self.rdp = rdp
        self.reduce_dtype = reduce_dtype
        self.offsets: list[int] = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.main = torch.zeros(total, dtype=torch.float32, device=device)
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets, strict=True):
                self.main[off : off + p.numel()].copy_(materialize(p).reshape(-1))
        self.compute = self.main if compute_dtype == torch.float32 else self.main.to(compute_dtype)
        for p, off in zip(self.params, self.offsets, strict=True):
            set_param_data(p, self.compute[off : off + p.numel()].view(p.shape))
        self.main_grad: torch.Tensor | None = None
        self.grad_used = [False] * len(self.params)

    def main_view(self, i: int) -> torch.Tensor:
        p, off = self.params[i], self.offsets[i]
        return self.main[off : off + p.numel()].view(p.shape)

    def grad_view(self, i: int) -> torch.Tensor | None:
        if self.main_grad is None:
            return None
        p, off = self.params[i], self.offsets[i]
        return self.main_grad[off : off + p.numel()].view(p.shape)

    def drop_stale_grads(self) -> None:
        """After a backward that raised: collect_grads frees every .grad it takes, so one here is left over
        from a backward that raised, and autograd would add the next backward's gradient to it."""
        for p in self.params:
            p.grad = None

    def collect_grads(self, *, scale: float = 1.0) -> None:
        """End of a backward: add the autograd grads times `scale` into the fp32 main grad (summing
        micro-steps; see [Note: micro-batch averaging] in model.py)."""
        if not any(p.grad is not None for p in self.params):
            return
        if self.main_grad is None:
            self.main_grad = torch.zeros_like(self.main)
        for i, (p, off) in enumerate(zip(self.params, self.offsets, strict=True)):
            if p.grad is not None:
                self.main_grad[off : off + p.numel()].add_(p.grad.reshape(-1), alpha=scale)
                p.grad = None
                self.grad_used[i] = True

    def finish_accumulation(self, usage: torch.Tensor) -> torch.Tensor:
        """Accumulation boundary: average the persistent grads over the rdp group and, in the same
        call, the per-parameter "got a gradient" flags of the whole model (`usage`, 0/1 floats).
        Returns the averaged flags: > 0 where any rank saw a gradient for that parameter."""
        if self.main_grad is None and self.params:
            self.main_grad = torch.zeros_like(self.main)  # every rank must join the collective
        if self.rdp.size == 1:
            return usage
        grads = self.main_grad if self.main_grad is not None else self.main.new_zeros(0)
        payload = torch.cat([grads, usage.to(grads.device)]).to(self.reduce_dtype)
        self.engine.all_reduce(payload, self.rdp, op=ReduceOp.AVG)
        if self.main_grad is not None:
            self.main_grad.copy_(payload[: grads.numel()])
        return payload[grads.numel() :].float()

    def refresh_compute(self) -> None:
        """After the optimizer stepped the fp32 main copy: update the compute-dtype copy."""
        if self.compute is not self.main:
            self.compute.copy_(self.main)

    def load(self, values: Mapping[str, torch.Tensor]) -> None:
        """Set the parameters `values` names, keyed by this table's names (one per parameter: a tied
        parameter's other names are resolved by the caller, state_dict.load_full_state_dict)."""
        with torch.no_grad():
            for i, (name, _) in enumerate(self.named):
                if name in values:
                    self.main_view(i).copy_(values[name])
        self.refresh_compute()
