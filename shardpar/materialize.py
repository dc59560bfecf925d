"""Full values of one parameter at a time, for sharding at wrap time (delayed initialization)."""

from __future__ import annotations

import torch
from torch import nn

from shardpar.deferred_init import is_deferred, materialize, materialize_by_reset


class Materializer:
    """Full values of one parameter at a time (delayed initialization; see deferred_init.py).

    A parameter recorded under `smp.delay_param_initialization()` is replayed exactly; one that is
    merely on the meta device (accelerate's `init_empty_weights`) gets its module's own
    `reset_parameters()` with a fixed seed, the same on every rank; a real one is used as it is.
    Callers keep their shard and drop the full tensor, so a rank never holds more than one full
    parameter beyond its shards.
    """

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module = module
        self.device = device
        self._owner: dict[int, tuple[nn.Module, str]] = {}
        self._reset_values: dict[int, torch.Tensor] = {}
        for m in module.modules():
            for name, p in m.named_parameters(recurse=False):
                self._owner.setdefault(id(p), (m, name))

    def __call__(self, p: nn.Parameter) -> torch.Tensor:
        if is_deferred(p):
            return materialize(p, self.device)
        if p.is_meta:
            if id(p) not in self._reset_values:
                # Reset the owning module's parameters together, while they are all still meta
                # (a module's reset_parameters reads its siblings, e.g. Linear's bias reads the weight).
                owner, _ = self._owner[id(p)]
                for name, q in owner.named_parameters(recurse=False):
                    if q.is_meta and not is_deferred(q):
                        self._reset_values[id(q)] = materialize_by_reset(owner, name, device=self.device, seed=0)
            return self._reset_values.pop(id(p))
        return p.detach()

    def buffers(self) -> None:
        """Buffers are replicated, not sharded: materialise them whole, in place."""
        for m in self.module.modules():
            for name, b in list(m._buffers.items()):
                if b is not None and (is_deferred(b) or b.is_meta):
                    m._buffers[name] = (
                        materialize(b, self.device) if is_deferred(b) else torch.zeros_like(b, device=self.device)
                    )
