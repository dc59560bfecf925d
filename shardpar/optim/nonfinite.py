"""The non-finite guard of bf16/fp32 steps: skip the step everywhere, say which ranks, give up after
`sdp_max_nonfinite_steps` in a row.

[Note: non-finite steps]
A NaN/inf loss or gradient on any rank reaches every rank's global grad norm with no extra collective:

    rank r: loss NaN --model.backward multiplies the loss by NaN (1.0 otherwise: exact)--> every grad of
            rank r NaN --ReduceScatter (sharding group)--> every shard NaN
                       --replication AllReduce / persistent rdp AllReduce--> every replica's shards NaN
    the norm: one AllReduce over the sharding group (and TP) -> NaN on every rank alike

So every rank takes the same decision from its own norm (one host sync, `.item()`, which fp16 already
paid for its overflow check), and the healthy path gains no collective. Only a skipped step pays one
more: a [world, 2] AllReduce of per-rank flags, so the log and the error can name the ranks. A rank can
tell whether the loss *it* passed to `model.backward` was non-finite; for gradients it only knows whether
its reduced shard is, which after the ReduceScatter says where the NaN landed, not who produced it.

fp16 keeps the loss scaler's rule (an overflow lowers the scale and skips, without a limit): overflow
is its normal way of finding the scale.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from shardpar.collectives import Engine, Group

log = logging.getLogger(__name__)

KNOB = "sdp_max_nonfinite_steps"


class NonFiniteError(RuntimeError):
    """More consecutive non-finite optimizer steps than `sdp_max_nonfinite_steps` allows."""


@dataclass(frozen=True)
class Culprits:
    """Global ranks behind a non-finite step, as each rank could tell about itself."""

    loss: tuple[int, ...]  # passed a non-finite loss to model.backward in this window
    shard: tuple[int, ...]  # hold a non-finite reduced gradient shard (or persistent grad)

    def describe(self) -> str:
        loss = f"ranks {list(self.loss)}" if self.loss else "no rank (none passed through model.backward)"
        shard = f"ranks {list(self.shard)}" if self.shard else "no rank"
        return (
            f"non-finite loss in model.backward on {loss}; non-finite reduced gradient shards on {shard} "
            "(where the values landed after the ReduceScatter, not necessarily who produced them)"
        )


def gather_culprits(
    engine: Engine, world: Group, rank: int, *, loss_bad: torch.Tensor, shard_bad: torch.Tensor
) -> Culprits:
    """One AllReduce of a [world, 2] table over the world, each rank filling its own row: run only when
    the norm is non-finite, which every rank sees alike ([Note: non-finite steps])."""
    table = torch.zeros(world.size, 2, dtype=torch.float32, device=loss_bad.device)
    row = world.ranks.index(rank)
    table[row, 0] = loss_bad.to(torch.float32)
    table[row, 1] = shard_bad.to(torch.float32)
    engine.all_reduce(table.view(-1), world)
    flags = table.cpu().tolist()
    return Culprits(
        loss=tuple(world.ranks[i] for i, f in enumerate(flags) if f[0]),
        shard=tuple(world.ranks[i] for i, f in enumerate(flags) if f[1]),
    )


class NonFiniteGuard:
    """Counts consecutive skipped steps and decides when to give up."""

    def __init__(self, max_skips: int) -> None:
        self.max_skips = max_skips
        self.num_skipped_in_a_row = 0
        self.first_skipped_step = 0

    def passed(self) -> None:
        self.num_skipped_in_a_row = 0

    def skip(self, *, step: int, norm: float, culprits: Culprits) -> str:
        """Record a skipped step; return the log line, or raise NonFiniteError past the limit."""
        if self.num_skipped_in_a_row == 0:
            self.first_skipped_step = step
        self.num_skipped_in_a_row += 1
        n, limit = self.num_skipped_in_a_row, self.max_skips
        if n > limit:
            steps = f"step {step}" if n == 1 else f"steps {self.first_skipped_step}-{step}"
            raise NonFiniteError(
                f"the global gradient norm was non-finite ({norm}) at {n} consecutive optimizer steps ({steps}), "
                f"more than {KNOB}={limit} allows; at the last one: {culprits.describe()}. The weights and "
                f"optimizer state are those from before optimizer step {self.first_skipped_step}. Check the data "
                f"those ranks read, lower the learning rate or enable sdp_gradient_clipping, or raise {KNOB}"
            )
        return (
            f"optimizer step {step} skipped on every rank: the global gradient norm is {norm}; {culprits.describe()}; "
            f"weights and optimizer state unchanged ({n} consecutive skip{'s' if n > 1 else ''}, {KNOB}={limit})"
        )
