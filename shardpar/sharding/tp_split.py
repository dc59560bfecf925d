"""How a TP-local parameter relates to the full one (pure math, no torch.distributed).

A TP-split parameter is the full tensor cut along one dim. Fused projections whose output is
`num_parts` blocks side by side (GPT-2's `c_attn` = [q | k | v]) are cut block by block, so every rank
keeps whole heads of each of q, k and v:

    full along `dim`:   [ q0 q1 | k0 k1 | v0 v1 ]      (num_parts 3, tp 2)
    rank 0 keeps:       [ q0 | k0 | v0 ]
    rank 1 keeps:       [ q1 | k1 | v1 ]

With num_parts 1 this is the plain contiguous split of Megatron-LM's Column/RowParallelLinear. GPT-NeoX's
fused `query_key_value` needs no parts: its rows are already grouped per head as [q k v] blocks, so a
contiguous cut hands out whole heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPSplit:
    """The full tensor is cut along `dim` into `num_parts` equal blocks, each block into `size`
    contiguous pieces; TP rank r holds piece r of every block, concatenated in block order."""

    dim: int
    size: int
    num_parts: int = 1

    def check_full_dim(self, extent: int, what: str) -> None:
        if extent % (self.size * self.num_parts):
            parts = f" x {self.num_parts} fused parts" if self.num_parts > 1 else ""
            raise ValueError(
                f"{what}: dim {self.dim} has {extent} entries, not divisible by tensor_parallel_degree "
                f"{self.size}{parts}"
            )

    def local_of(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """TP rank `rank`'s piece of `full` (a view when num_parts is 1)."""
        if not 0 <= rank < self.size:
            raise AssertionError(f"TP rank {rank} outside a group of {self.size}")
        self.check_full_dim(full.shape[self.dim], f"tensor of shape {tuple(full.shape)}")
        blocks = full.chunk(self.num_parts, dim=self.dim)
        pieces = [b.chunk(self.size, dim=self.dim)[rank] for b in blocks]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)

    def full_of(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """Reassemble the full tensor from every TP rank's piece, in TP-rank order."""
        if len(pieces) != self.size:
            raise AssertionError(f"{len(pieces)} pieces for a TP group of {self.size}")
        per_rank = [p.chunk(self.num_parts, dim=self.dim) for p in pieces]
        blocks = [torch.cat([parts[b] for parts in per_rank], dim=self.dim) for b in range(self.num_parts)]
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=self.dim)

    def full_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] *= self.size
        return tuple(shape)
