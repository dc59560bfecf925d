"""Where each original parameter lives on this rank, as the checkpoint code sees it (no I/O here).

A *slot* is one original parameter on this rank: the flat element range [start, start + length) it
holds of the flattened parameter (all of it for a persistent parameter), its fp32 main values, and
the optimizer piece (DistributedOptimizer's main piece) whose state belongs to those elements. Under
tensor parallelism "the parameter" is this TP rank's local one; `cut` and `tp_rank` say where it
sits in the full Hugging Face parameter ([Note: full-parameter coordinates] in placement.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardpar.checkpoint import index as ix
from shardpar.checkpoint.placement import Cut
from shardpar.optim.optimizer import DistributedOptimizer
from shardpar.runtime.model import DistributedModel
from shardpar.runtime.sharded_tensor import ShardedTensor
from shardpar.runtime.state_dict import persistent_buffers as module_persistent_buffers
from shardpar.tensor_parallel.layers import tp_split_table


@dataclass(frozen=True)
class Slot:
    """Where one original parameter lives on this rank: its optimizer piece and flat element range."""

    fqn: str
    param: nn.Parameter
    start: int
    length: int
    shape: tuple[int, ...]  # the piece's shape: (length,) when sharded, the parameter's when persistent
    view: torch.Tensor  # this rank's fp32 main values (a view); read and write them through `value`
    sharded: bool
    param_shape: tuple[int, ...]  # the (TP-local) parameter's; its .data is empty while sharded
    cut: Cut  # how TP ranks' parameters make up the full one; cut.full_shape is the Hugging Face shape
    tp_rank: int  # which of cut.size local parameters this is (0 when not TP-split)
    # shard_optimizer_state: this rank's piece is its own, not a copy held by every replica
    # ([Note: replica-sharded main], runtime/replica_shard.py)
    replica_owned: bool = False
    # does not train (frozen at wrap time): a partial checkpoint records it by a fingerprint, not its
    # values ([Note: adapter-only checkpoints] in fingerprint.py)
    frozen: bool = False
    # A quantized frozen base (int8 / nf4) keeps no exact values ([Note: quantized base keeps no exact
    # shard], runtime/frozen_exact.py): `hold` gives `view` its (dequantized) values back for a reader or
    # a load, and `exact_crc` is the checksum of the exact values it had, for the fingerprint.
    hold: Callable[[], None] | None = None
    exact_crc: int | None = None
    # frozen, in a shard the module's parameters never view: every write to it is one its version counter
    # sees, so its hash may be reused while that counter stands ([Note: fingerprint cache] in fingerprint.py)
    private: bool = False
    # ShardedState.writes when the slot was taken: writes the version counter does not see move it
    writes: int = 0

    @property
    def value(self) -> torch.Tensor:
        """`view`, with its values there (a quantized frozen piece's given back until the next refresh)."""
        if self.hold is not None:
            self.hold()
        return self.view

    @property
    def tp_split(self) -> bool:
        return self.cut.size > 1


def slots(model: DistributedModel) -> list[Slot]:
    splits, tp_rank = tp_split_table(model.module), model.topology.coords.tp_rank

    def placed(fqn: str, shape: tuple[int, ...]) -> tuple[Cut, int]:
        cut = Cut.of(shape, splits.get(fqn))
        return cut, tp_rank if cut.size > 1 else 0

    state = model.sharded_state
    out = []
    for piece in state.pieces:
        shape = (piece.length,) if piece.sharded else piece.shape
        cut, rank = placed(piece.fqn, piece.shape)
        quantized = state.quantized_frozen(piece)
        out.append(
            Slot(
                piece.fqn,
                piece.param,
                piece.start,
                piece.length,
                shape,
                state.main(piece),
                piece.sharded,
                piece.shape,
                cut,
                rank,
                piece.sharded and not piece.frozen and state.replica_sharded,  # a frozen shard: every replica's
                piece.frozen or not piece.param.requires_grad,
                None if quantized is None else quantized.hold_values,
                None if quantized is None else quantized.exact_crcs.get(piece.fqn),
                state.frozen_shard_private(piece),
                state.writes,
            )
        )
    return out


def persistent_buffers(model: DistributedModel) -> dict[str, torch.Tensor]:
    """Buffers that belong in a state dict (non-persistent ones are rebuilt by the model); a buffer
    registered under several names is written once, under its first."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, b in module_persistent_buffers(model.module).items():
        if id(b) not in seen:
            seen.add(id(b))
            out[name] = b
    return out


def buffer_shape_problems(buffers: Mapping[str, torch.Tensor], saved: Mapping[str, Sequence[int]]) -> list[str]:
    """Buffers saved with another shape: copy_ would broadcast a smaller one, or fail after the
    parameters were written, so a load checks them first."""
    return [
        f"buffer {b}: shape {list(t.shape)} in the model, {list(saved[b])} in the checkpoint"
        for b, t in buffers.items()
        if b in saved and list(t.shape) != list(saved[b])
    ]


def piece_of(optimizer: DistributedOptimizer, p: nn.Parameter) -> torch.Tensor | None:
    return optimizer.main_piece(p)


def split_state(slot: Slot, state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(per-element tensors, JSON scalars) of one piece's optimizer state."""
    per_element, scalars = {}, {}
    for k, v in state.items():
        if isinstance(v, ShardedTensor):  # state of an optimizer that steps the user parameters
            v = v.local_piece
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            if tuple(v.shape) != slot.shape:
                raise ValueError(
                    f"optimizer state {k!r} of {slot.fqn!r} has shape {tuple(v.shape)}, not the parameter piece's "
                    f"{slot.shape}; only per-element and scalar optimizer state can be checkpointed and resharded"
                )
            per_element[k] = v
        else:
            scalars[k] = ix.encode(v, where=f"optimizer state {k!r} of {slot.fqn!r}")
    return per_element, scalars


def fqn_of_piece(model: DistributedModel, optimizer: DistributedOptimizer) -> dict[int, str]:
    """id(optimizer piece) -> the parameter's FQN (tied parameters: their first name)."""
    out = {}
    for name, p in model.module.named_parameters():
        piece = piece_of(optimizer, p)
        if piece is not None:
            out[id(piece)] = name
    return out
