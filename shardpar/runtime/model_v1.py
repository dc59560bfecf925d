"""DistributedModel's SageMaker model parallel v1 surface: `partitioned`, `get_module`, the local_*
views and post-partition and post-step hooks (docs/migration.md lists each name).

A mixin, listed before nn.Module in DistributedModel's bases (runtime/model.py); it owns none of the
attributes it reads -- DistributedModel.__init__ sets them, and its `forward` runs the hooks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


class V1Mixin(nn.Module):
    """The SMP v1 names of a DistributedModel that only read the wrapped module or keep hooks."""

    # Set by DistributedModel.__init__ (runtime/model.py).
    module: nn.Module
    _find_optimizer: Callable[[], Any]  # for post-partition hooks (the facade's optimizer)
    _post_partition_hooks: OrderedDict[int, Callable[[Any, Any], None]]
    _post_step_hooks: OrderedDict[int, Callable[[Any, Any], None]]

    def get_module(self) -> nn.Module:
        """SMP v1: the wrapped module (`model.module`)."""
        return self.module

    @property
    def partitioned(self) -> bool:
        """SMP v1: whether the model is partitioned; here it is sharded when wrapped, so always."""
        return True

    # SMP v1's local_* views: with pipeline_parallel_degree 1 every module is this rank's.
    def local_parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    def local_buffers(self) -> Iterator[torch.Tensor]:
        return self.module.buffers()

    def local_named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers()

    def local_modules(self) -> Iterator[nn.Module]:
        return self.module.modules()

    def local_named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        return self.module.named_modules()

    def register_post_partition_hook(self, hook: Callable[[Any, Any], None]) -> RemovableHandle:
        """SMP v1: `hook(model, optimizer)` runs once, before the first forward -- the model is
        partitioned (sharded) when it is wrapped, so that is the first moment both exist. Returns a
        handle whose `remove()` cancels it."""
        if not callable(hook):
            raise TypeError(f"register_post_partition_hook needs a callable hook(model, optimizer), got {hook!r}")
        handle = RemovableHandle(self._post_partition_hooks)
        self._post_partition_hooks[handle.id] = hook
        return handle

    def _run_post_partition_hooks(self) -> None:
        hooks = list(self._post_partition_hooks.values())
        self._post_partition_hooks.clear()  # once, even if one raises
        optimizer = self._find_optimizer()
        for hook in hooks:
            hook(self, optimizer)

    def register_post_step_hook(self, hook: Callable[[Any, Any], None]) -> RemovableHandle | None:
        """SMP v1: `hook(model, optimizer)` once the model is partitioned and its optimizer exists -- at
        once (returning None) when an smp.DistributedOptimizer of this model exists, as v1 did after its
        first step; otherwise after the next `@smp.step` call, returning a handle whose `remove()` cancels
        it. Scripts load optimizer state this way."""
        if not callable(hook):
            raise TypeError(f"register_post_step_hook needs a callable hook(model, optimizer), got {hook!r}")
        optimizer = self._find_optimizer()
        if optimizer is not None and getattr(optimizer, "model", None) is self:
            hook(self, optimizer)
            return None
        handle = RemovableHandle(self._post_step_hooks)
        self._post_step_hooks[handle.id] = hook
        return handle

    def run_post_step_hooks(self) -> None:
        """Called by `@smp.step` after its micro-batches: the hooks registered before, once each."""
        if not self._post_step_hooks:
            return
        hooks = list(self._post_step_hooks.values())
        self._post_step_hooks.clear()
        optimizer = self._find_optimizer()
        for hook in hooks:
            hook(self, optimizer)
