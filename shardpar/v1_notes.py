"""One rank-0 log line for an SMP v1 name whose v1 meaning cannot apply here: the name is accepted and
the line says what it does instead (issue 30). Logger "shardpar", level WARNING (shown without any
logging set-up), once per process and name, so a call in the training loop does not repeat it."""

from __future__ import annotations

import logging

import torch.distributed as dist

_LOG = logging.getLogger("shardpar")
_said: set[str] = set()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def note_once(name: str, what_here: str) -> None:
    """Log `<name>: <what_here>` on rank 0, the first time `name` is noted in this process."""
    if name in _said:
        return
    _said.add(name)
    if _rank() == 0:
        _LOG.warning("SMP v1 %s: %s", name, what_here)
