"""Preemption: SIGTERM (what SageMaker spot, Kubernetes and SLURM send before killing) -> save, exit.

[Note: preemption at a step boundary]
The signal arrives on one rank, or on all at slightly different times, in the middle of a step. The
handler only sets a flag: saving from inside the handler would start collectives at a different
point on each rank. At the step boundary every rank calls `preemption_requested()` (one small
all-gather of the flags over the world group; the recipes fold the flag into the all-gather they run
anyway), so all ranks see the same answer at the same step: if any rank was signalled, all save the
same checkpoint (synchronously, or by committing the pending async one) and exit with
PREEMPTED_EXIT_CODE after printing one line naming the checkpoint. Schedulers give a grace period
(SageMaker spot 2 minutes, Kubernetes terminationGracePeriodSeconds, 30 s by default; SLURM
KillWait) after which SIGKILL follows: a save must fit in it.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, NoReturn

from shardpar.api.context import CommGroup, allgather

# 128 + SIGTERM, what the process would have returned had the signal killed it: schedulers that restart
# on failure (SageMaker managed spot, Kubernetes restartPolicy, SLURM --requeue) treat it alike, and
# the printed line tells a person the job saved first.
PREEMPTED_EXIT_CODE = 143

_signalled: list[int] = []  # the signal numbers received since handle_preemption (append is atomic)
_previous: dict[int, Any] = {}


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _signalled.append(signum)  # only a flag: see [Note: preemption at a step boundary]


def handle_preemption(signals: Iterable[int] = (signal.SIGTERM,)) -> None:
    """Install a handler for `signals` (default SIGTERM) that only records the signal; the training loop
    asks `preemption_requested()` at each step boundary. Call from the main thread (Python's rule for
    signal handlers). `stop_handling_preemption()` restores the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        raise ValueError(
            "smp.handle_preemption() was called from thread "
            f"{threading.current_thread().name!r}: Python installs signal handlers only from the main thread; "
            "call it from the main thread before training"
        )
    for s in signals:
        if s not in _previous:
            _previous[s] = signal.signal(s, _on_signal)


def stop_handling_preemption() -> None:
    """Restore the handlers `handle_preemption` replaced and forget any recorded signal."""
    for s, old in _previous.items():
        signal.signal(s, old if old is not None else signal.SIG_DFL)
    _previous.clear()
    _signalled.clear()


def preemption_signalled() -> bool:
    """This rank's flag alone (not collective): whether a handled signal arrived. To decide, every rank
    must see the same answer: use preemption_requested(), or fold this flag into an all-gather."""
    return bool(_signalled)


def preemption_requested() -> bool:
    """Collective, at the same step boundary on every rank: True on every rank when any rank was signalled."""
    return any(allgather(preemption_signalled(), CommGroup.WORLD))


def exit_preempted(
    checkpoint: str | None, step: int | None = None, say: Callable[[str], None] | None = None
) -> NoReturn:
    """Print the line that says the job was preempted and where it saved, then exit with PREEMPTED_EXIT_CODE."""
    where = f"saved {checkpoint}" if checkpoint else "nothing saved"
    at = f" at step {step}" if step is not None else ""
    names = ", ".join(signal.Signals(s).name for s in sorted(set(_signalled))) or "on another rank"
    line = (
        f"shardpar: preempted (signal {names}){at}: {where}; exiting with code {PREEMPTED_EXIT_CODE}. "
        "Start the job again to resume from it."
    )
    (say or (lambda text: print(text, file=sys.stderr, flush=True)))(line)
    raise SystemExit(PREEMPTED_EXIT_CODE)
