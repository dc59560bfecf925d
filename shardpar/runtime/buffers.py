"""Buffers kept equal on every rank, as DDP's `broadcast_buffers=True` does.

Buffers are not sharded: every rank of a reduced-data-parallel group holds the whole module's. Those a
forward updates from its own batch (BatchNorm's running_mean / running_var / num_batches_tracked)
drift apart across ranks, and an export keeps rank 0's (issue 20 measured eval outputs 0.14 apart).
So the rdp group's first rank broadcasts them when the model is wrapped and before every forward, one
collective per dtype. DDP broadcasts only before forwards that record a graph; then an eval forward
after training still sees each rank's own statistics, and ranks answer differently -- the symptom
itself. Only the buffers a state dict holds are sent: non-persistent ones (rotary caches) are derived
state that every rank builds alike, so a model without persistent buffers (the HF language models)
pays nothing.
"""

from __future__ import annotations

import torch

from shardpar.collectives import Engine, Group


class BufferSync:
    def __init__(self, buffers: list[torch.Tensor], *, engine: Engine, group: Group) -> None:
        unique: dict[int, torch.Tensor] = {}
        for b in buffers:
            if not b.is_meta:
                unique.setdefault(id(b), b)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in unique.values():
            by_dtype.setdefault(b.dtype, []).append(b)
        self._groups = list(by_dtype.values())
        self._engine = engine
        self._group = group

    @property
    def active(self) -> bool:
        return self._group.size > 1 and bool(self._groups)

    def sync(self) -> None:
        """Every rank of the group takes the first rank's buffers (a collective: all ranks call it)."""
        if not self.active:
            return
        src = self._group.ranks[0]
        with torch.no_grad():
            for buffers in self._groups:
                flat = torch.cat([_sendable(b).reshape(-1) for b in buffers])
                self._engine.broadcast(flat, src, self._group)
                offset = 0
                for b in buffers:
                    n = b.numel()
                    _sendable(b).copy_(flat[offset : offset + n].view(b.shape))
                    offset += n


def _sendable(b: torch.Tensor) -> torch.Tensor:
    """gloo broadcasts no bool tensors: send their bytes."""
    return b.view(torch.uint8) if b.dtype == torch.bool else b
