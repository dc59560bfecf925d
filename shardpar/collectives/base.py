"""The Engine protocol: every collective shardpar issues goes through one of these.

An engine works on flat tensors and explicit groups. Calls return a `Work` handle; with
``async_op=False`` the handle is already complete when the call returns. Byte accounting is done by
`shardpar.collectives.stats.CountingEngine`, which wraps any engine.

Shapes (n = group.size):

    all_gather:      input [k]        -> output [n*k]   (block i of output is rank i's input)
    reduce_scatter:  input [n*k]      -> output [k]     (rank i gets the reduced block i)
    reduce_scatter_pieces: the same, input given as pieces end to end (tensors, or counts of zeros)
    all_reduce:      tensor [k]       -> tensor [k]     (in place)
    broadcast:       tensor [k]       -> tensor [k]     (in place, from global rank `src`)
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"


@dataclass(frozen=True)
class Group:
    """A set of global ranks that communicate together, plus the backend object that serves it.

    `kind` is a glossary word ("sharding", "replication", "tp", ...) used by the byte accounting;
    `handle` is whatever the engine needs (a torch ProcessGroup for the native engine), or None when
    this rank is not a member.
    """

    kind: str
    ranks: tuple[int, ...]
    handle: Any = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_of(self, global_rank: int) -> int:
        """Position of `global_rank` inside this group."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise AssertionError(f"rank {global_rank} is not in {self.kind} group {self.ranks}") from None


# A piece of a ReduceScatter input: a 1-D contiguous tensor, or an int k standing for k zeros.
Piece = torch.Tensor | int


@runtime_checkable
class Work(Protocol):
    def wait(self, timeout: float | None = None) -> None:
        """Block until the collective finished; raise on failure or after `timeout` seconds."""
        ...

    def is_completed(self) -> bool: ...


class CompletedWork:
    """The handle of a collective that already finished (synchronous calls, groups of one)."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


@runtime_checkable
class Engine(Protocol):
    """What the runtime needs from a collective backend."""

    name: str

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: Group, *, async_op: bool = False
    ) -> Work: ...

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: Group,
        *,
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
    ) -> Work: ...

    def reduce_scatter_pieces(
        self,
        output: torch.Tensor,
        pieces: Sequence[Piece],
        group: Group,
        *,
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
    ) -> Work:
        """reduce_scatter of the pieces laid end to end; the pieces must stay unchanged until it is done."""
        ...

    def reads_pieces(self, output: torch.Tensor, group: Group) -> bool:
        """Whether reduce_scatter_pieces reads the pieces where they lie. If not, it packs them into one
        buffer first, and a caller that can pack as the pieces arrive should do so itself."""
        ...

    def all_reduce(
        self, tensor: torch.Tensor, group: Group, *, op: ReduceOp = ReduceOp.SUM, async_op: bool = False
    ) -> Work: ...

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group, *, async_op: bool = False) -> Work: ...

    def barrier(self, group: Group) -> None: ...

    def alloc_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A communication buffer owned by the engine (shared memory, registered memory, ...)."""
        ...


def check_gather_shapes(output: torch.Tensor, input: torch.Tensor, group: Group, op: str) -> None:
    """Validate the flat-tensor contract shared by all_gather and reduce_scatter."""
    big, small = (output, input) if op == "all_gather" else (input, output)
    if big.numel() != small.numel() * group.size:
        raise ValueError(
            f"{op}: the large tensor has {big.numel()} elements but must have "
            f"group size {group.size} x {small.numel()} = {group.size * small.numel()}"
        )
    if big.dtype != small.dtype:
        raise ValueError(f"{op}: dtypes differ ({input.dtype} in, {output.dtype} out); use one dtype")
    if not (big.is_contiguous() and small.is_contiguous()):
        raise ValueError(f"{op}: tensors must be contiguous; call .contiguous() first")


def check_pieces(output: torch.Tensor, pieces: Sequence[Piece], group: Group) -> int:
    """Validate a reduce_scatter_pieces call on the caller, before any rank enters it; returns the
    number of input elements."""
    total = 0
    for i, piece in enumerate(pieces):
        if isinstance(piece, int):
            if piece < 0:
                raise ValueError(f"reduce_scatter_pieces: piece {i} asks for {piece} zeros; a count must be >= 0")
            total += piece
            continue
        if piece.dtype != output.dtype or piece.device != output.device or not piece.is_contiguous():
            raise ValueError(
                f"reduce_scatter_pieces: pieces[{i}] ({piece.dtype} on {piece.device}, contiguous="
                f"{piece.is_contiguous()}) must be contiguous and match output ({output.dtype} on {output.device})"
            )
        total += piece.numel()
    if total != group.size * output.numel():
        raise ValueError(
            f"reduce_scatter_pieces: the pieces hold {total} elements but must hold group size "
            f"{group.size} x {output.numel()}; pad with an int piece of zeros"
        )
    return total


def pack_pieces(pieces: Sequence[Piece], output: torch.Tensor) -> torch.Tensor:
    """The pieces end to end in one new buffer (for engines that cannot read them in place)."""
    total = sum(p if isinstance(p, int) else p.numel() for p in pieces)
    buffer = torch.empty(total, dtype=output.dtype, device=output.device)
    at = 0
    for piece in pieces:
        n = piece if isinstance(piece, int) else piece.numel()
        if isinstance(piece, int):
            buffer[at : at + n].zero_()
        else:
            buffer[at : at + n].copy_(piece.reshape(-1))
        at += n
    return buffer
