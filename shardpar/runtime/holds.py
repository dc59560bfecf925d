"""Why a unit is gathered: its state and its holds ([Note: holders] in unit.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class UnitState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDING = "unsharding"  # AllGather issued, buffer allocated, not waited for yet
    UNSHARDED = "unsharded"


class HoldKind(enum.Enum):
    """Why a unit is kept unsharded ([Note: holders])."""

    FORWARD = "forward"
    BACKWARD = "backward"
    PREFETCH = "prefetch"


@dataclass(frozen=True, slots=True)
class Hold:
    """One reason a unit is unsharded: `kind`, for the unit itself (`borrower` None) or for unit
    `borrower`, which uses its parameters ([Note: holders])."""

    kind: HoldKind
    borrower: int | None = None


# A unit's own holds; the borrowed ones are built once per unit (`Unit.lent_holds`): no allocation per call.
FORWARD = Hold(HoldKind.FORWARD)
BACKWARD = Hold(HoldKind.BACKWARD)
PREFETCH = Hold(HoldKind.PREFETCH)
