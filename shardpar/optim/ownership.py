"""Which rank steps each whole parameter of a shape-aware optimizer ([Note: owner compute] in
docs/design.md section 17 and owner_compute.py): a greedy balance of the optimizer's work and memory.

Pure arithmetic on shapes, so `shardpar estimate` and the wrap-time log print the same plan the
optimizer runs, and every rank computes the same plan without talking.

    cost (work)   Muon: its Newton-Schulz iterations multiply m x n matrices, ~ m * n * min(m, n)
                  anything else: ~ numel (one pass over the parameter and its state)
    bytes         the owner's whole fp32 copy of the parameter plus the optimizer's state for it

Parameters are placed largest cost first, each on the member where the larger of its cost share and
its byte share after placing it is smallest (LPT scheduling on two resources): with many parameters
per member both loads come out within a few percent of the even share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

FP32 = 4


def kind_of(class_name: str) -> str:
    """The cost model of an optimizer class: 'muon', 'adafactor' or 'generic'."""
    lowered = class_name.lower()
    if "muon" in lowered:
        return "muon"
    if "adafactor" in lowered:
        return "adafactor"
    return "generic"


def work(shape: Sequence[int], kind: str) -> float:
    """Relative cost of stepping one whole parameter of `shape`."""
    numel = math.prod(shape)
    if kind == "muon" and len(shape) >= 2:
        rows, cols = shape[0], numel // shape[0]
        return float(rows * cols * min(rows, cols))
    return float(numel)


def state_bytes(shape: Sequence[int], kind: str) -> int:
    """fp32 optimizer-state bytes for one parameter: Muon keeps a momentum buffer; torch's Adafactor
    (beta1 off, its default) row and column statistics of a matrix, a full second moment otherwise;
    an unknown optimizer is assumed to keep two moments, as Adam does."""
    numel = math.prod(shape)
    if kind == "muon":
        return numel * FP32
    if kind == "adafactor":
        if len(shape) >= 2:
            rows, cols = math.prod(shape[:-1]), shape[-1]
            return (rows + cols) * FP32
        return numel * FP32
    return 2 * numel * FP32


@dataclass(frozen=True)
class Owned:
    """One parameter stepped whole, and where."""

    fqn: str
    shape: tuple[int, ...]  # as the owner steps it (TP-merged under tensor parallelism)
    owner: int  # member index in the exchange group
    work: float
    bytes: int  # the owner's fp32 copy plus the optimizer state


@dataclass(frozen=True)
class OwnerPlan:
    members: int
    owned: tuple[Owned, ...]

    def of(self, member: int) -> list[Owned]:
        return [o for o in self.owned if o.owner == member]

    def load(self, attr: str) -> list[float]:
        out = [0.0] * self.members
        for o in self.owned:
            out[o.owner] += getattr(o, attr)
        return out

    def imbalance(self, attr: str) -> float:
        """max member load / even share (1.0: perfectly even); 1.0 when there is nothing to share."""
        loads = self.load(attr)
        total = sum(loads)
        return max(loads) / (total / self.members) if total else 1.0

    def text(self) -> str:
        """One line for the wrap log and `shardpar estimate`."""
        if not self.owned:
            return "owner compute: no parameter needs a whole-matrix step"
        per = self.load("bytes")
        return (
            f"owner compute: {len(self.owned)} parameters stepped whole by one owner each across {self.members} "
            f"ranks; owner bytes per rank {min(per) / 2**20:.2f}-{max(per) / 2**20:.2f} MiB "
            f"(max/even {self.imbalance('bytes'):.2f}), work max/even {self.imbalance('work'):.2f}"
        )


def plan_owners(params: Sequence[tuple[str, tuple[int, ...]]], kind: str, members: int) -> OwnerPlan:
    """Assign each (fqn, shape) to one of `members` ranks; deterministic (ties go to the lowest
    member, equal parameters keep their order), so every rank computes the same plan."""
    if members < 1:
        raise AssertionError(f"owner plan over {members} members")
    items = [
        (fqn, tuple(shape), work(shape, kind), math.prod(shape) * FP32 + state_bytes(shape, kind))
        for fqn, shape in params
    ]
    total_work = sum(i[2] for i in items) or 1.0
    total_bytes = sum(i[3] for i in items) or 1
    loads = [[0.0, 0.0] for _ in range(members)]
    owner: dict[str, int] = {}
    for fqn, _, w, b in sorted(items, key=lambda i: (-i[2], -i[3])):  # stable: equal ones keep their order

        def after(m: int, w: float = w, b: float = b) -> float:
            return max((loads[m][0] + w) / total_work, (loads[m][1] + b) / total_bytes)

        best = min(range(members), key=after)
        loads[best][0] += w
        loads[best][1] += b
        owner[fqn] = best
    return OwnerPlan(members, tuple(Owned(f, s, owner[f], w, b) for f, s, w, b in items))
