"""Prefetch under the live-parameter cap (reference 003: "prefetches the upcoming layers ... overlaps
the network communication with the computation"; `sdp_max_live_parameters`).

The unit order of forward and of backward is recorded as it happens and replayed as a prediction
on the next pass: when unit i starts, the AllGather of the unit predicted after it is issued
asynchronously (a PREFETCH hold) and runs on the engine's thread (gloo) or stream (NCCL) while i
computes. A wrong prediction (another branch, eval, generate) costs only the wasted gather: the
unit actually needed is gathered on demand, stale prefetches are dropped at the end of the pass,
and the new order replaces the old one -- there is no trace to invalidate.

The Scheduler is the only caller of `Unit.unshard` / `wait_for_unshard` / `reshard` / `release`: the
hooks (hooks.py) tell it what happened -- a unit is required, its forward is done, its grads are
reduced, a borrowing call's backward is done, the backward or the step ended -- and it decides what
is gathered and what is freed ([Note: holders] in unit.py).

[Note: live cap]
Unsharded elements (gathered or in flight) never exceed `sdp_max_live_parameters`; a hierarchical
gather's scratch buffers count too while they are held ([Note: hierarchical chaining]):
  * a prefetch is issued only if it fits;
  * a required gather first evicts prefetched-only units; if the units that must be alive at once
    (the root, which stays gathered through forward, plus the current unit and its borrowed units)
    are still over the cap, they are gathered anyway -- training cannot proceed otherwise -- with a
    one-time warning that names the sizes and suggests finer units (`wrap=`) or a larger cap.
"""

from __future__ import annotations

import warnings

from shardpar.runtime.holds import BACKWARD, FORWARD, PREFETCH, Hold, HoldKind, UnitState
from shardpar.runtime.unit import Unit

_ONLY_PREFETCH = {PREFETCH}
_OWN: dict[HoldKind, Hold] = {HoldKind.FORWARD: FORWARD, HoldKind.BACKWARD: BACKWARD, HoldKind.PREFETCH: PREFETCH}


class LiveCounter:
    """Unsharded elements right now, with an optional trace of every change (for tests)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.trace: list[tuple[str, int, int]] | None = None  # (unit, delta, live after)

    def __call__(self, unit: Unit, delta: int) -> None:
        self.live += delta
        self.peak = max(self.peak, self.live)
        if self.trace is not None:
            self.trace.append((unit.name, delta, self.live))


class Scheduler:
    def __init__(self, units: list[Unit], *, cap: int, live: LiveCounter, prefetch_depth: int = 1) -> None:
        self.units = units
        self.cap = cap
        self.live = live
        self.prefetch_depth = prefetch_depth
        self.forward_order: list[Unit] = []
        self.backward_order: list[Unit] = []
        self._forward_now: list[Unit] = []
        self._backward_now: list[Unit] = []
        self._warned = False
        self._calls = 0  # the last token open_call handed out

    # ---- pass boundaries ------------------------------------------------------------------------

    def begin_forward(self) -> None:
        self._forward_now = []

    def end_forward(self) -> None:
        if self._forward_now:
            self.forward_order = self._forward_now
        self.drop_prefetches()

    def end_backward(self) -> None:
        """The end of a backward: free every unit (the root kept for it included) and record the order."""
        for unit in self.units:
            unit.release()
        if self._backward_now:
            self.backward_order = self._backward_now
        self._backward_now = []
        self.drop_prefetches()

    def release_all(self) -> None:
        """The end of an optimizer step: free what a graph-recording forward that got no backward left
        gathered (the root keeps its parameters for the backward); those values are stale now."""
        for unit in self.units:
            unit.open_calls.clear()  # calls from graphs that never got a backward
            unit.release()

    def hold_all(self) -> None:
        """model.unshard() (model_fsdp2.py): every unit gathered under its FORWARD hold, which its next
        forward drops after use as usual; `release_all` (a step, model.reshard()) frees the rest."""
        for unit in self.units:
            unit.unshard(FORWARD, async_op=True)
        for unit in self.units:
            unit.reshard(PREFETCH)  # a prefetch turned into a held unit (no-op otherwise)
            unit.wait_for_unshard()

    def drop_prefetches(self) -> None:
        for unit in self.units:
            if PREFETCH in unit.holds:
                unit.reshard(PREFETCH)

    # ---- per unit ------------------------------------------------------------------------------

    def require(self, unit: Unit, kind: HoldKind) -> None:
        """Unit `unit` is about to compute (its forward, or its backward when `kind` is BACKWARD): make it
        (and its borrowed units) gathered, then prefetch."""
        backward = kind is HoldKind.BACKWARD
        now = self._backward_now if backward else self._forward_now
        if unit not in now:  # a recomputation (or the root's second pre-backward) requires it again
            now.append(unit)
        self._make_room(unit)
        unit.unshard(_OWN[kind], async_op=True)
        unit.reshard(PREFETCH)  # a prefetch turned into a real use (no-op otherwise)
        unit.wait_for_unshard()
        order = self._predicted_order(backward)
        for nxt in self._next_units(order, unit):
            self._prefetch(nxt)

    def forward_done(self, unit: Unit) -> None:
        """The unit's forward returned: drop its forward hold (freed unless something else holds it)."""
        unit.reshard(FORWARD)

    def backward_done(self, unit: Unit) -> None:
        """The unit's backward no longer needs it: every gradient of a trainable unit was handed to the
        reducer, or a unit with frozen parameters saw its whole backward run ([Note: frozen units'
        backward] in hooks.py)."""
        unit.reshard(BACKWARD)
        unit.reshard(FORWARD)

    def open_call(self, unit: Unit) -> int:
        """A graph-recording call of `unit` whose backward ends in `close_call(unit, token)`."""
        self._calls += 1
        unit.open_calls.add(self._calls)
        return self._calls

    def close_call(self, unit: Unit, token: int) -> bool:
        """The backward of one of the unit's calls has run, or its graph was freed without one (an
        activation checkpoint's recomputation, a forward never backwarded). Once no call is open its
        backward holds on the units it borrows from end ([Note: holders] in unit.py); returns whether
        none is open now (False when `token` was closed already)."""
        if token not in unit.open_calls:
            return False
        unit.open_calls.discard(token)
        if unit.open_calls:
            return False
        unit.release_borrowed()
        return True

    def _predicted_order(self, backward: bool) -> list[Unit]:
        if not backward:
            return self.forward_order
        return self.backward_order or list(reversed(self.forward_order))

    def _next_units(self, order: list[Unit], unit: Unit) -> list[Unit]:
        if unit not in order:
            return []
        i = order.index(unit)
        return order[i + 1 : i + 1 + self.prefetch_depth]

    def _prefetch(self, unit: Unit) -> None:
        if unit.state is not UnitState.SHARDED or unit.reduced:
            return
        if self.live.live + self._size_if_gathered(unit) > self.cap:
            return
        unit.unshard(PREFETCH, async_op=True)

    # ---- the cap --------------------------------------------------------------------------------

    def _size_if_gathered(self, unit: Unit) -> int:
        """Elements gathering `unit` (and its borrowed units) adds, with a hierarchical gather's scratch."""
        todo = [u for u in (unit, *unit.deps) if u.state is UnitState.SHARDED]
        return sum(u.gathered_numel + u.comm.gather_scratch(u.gathered_numel) for u in todo)

    def _make_room(self, unit: Unit) -> None:
        need = self._size_if_gathered(unit)
        if self.live.live + need <= self.cap:
            return
        keep = {id(unit), *(id(d) for d in unit.deps)}
        for other in self.units:
            if id(other) not in keep and other.holds == _ONLY_PREFETCH:
                other.reshard(PREFETCH)
                if self.live.live + need <= self.cap:
                    return
        if not self._warned:
            self._warned = True
            alive = [u.name for u in self.units if u.state is not UnitState.SHARDED]
            warnings.warn(
                f"sdp_max_live_parameters={self.cap} is smaller than what must be gathered together: "
                f"{self.live.live} elements alive in {alive} plus {need} for {unit.name!r}; gathering anyway. "
                "Raise the cap, or split the model into smaller units with DistributedModel(wrap=...)",
                stacklevel=3,
            )
