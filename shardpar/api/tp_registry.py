"""SMP v1's `smp.tp_register` / `smp.tp_register_with_module`: a registry of distributed replacements for
module classes, which v1's tensor parallelism swapped in. shardpar's tensor parallelism converts the
Hugging Face GPT-NeoX, Llama and GPT-2 modules itself (docs/tensor_parallelism.md) and has no registry:
a registration is accepted with one rank-0 log line, and the registered class stays as it is --
replicated over the TP group and sharded like any other module, so results do not change, only where
its parameters live."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from shardpar.v1_notes import note_once

_M = TypeVar("_M", bound=type)

_WHAT_HERE = (
    "accepted, and the module class is left as it is: shardpar splits the Hugging Face GPT-NeoX, Llama and GPT-2 "
    "blocks itself (smp.tensor_parallelism) and keeps no registry of distributed replacements; a registered class "
    "is replicated over the TP group and sharded like every other module"
)


def _check_module_class(where: str, cls: object) -> None:
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"{where} takes nn.Module classes, got {cls!r}")


def tp_register(smp_dist_module: type, init_hook: Callable[..., Any] | None = None, **hooks: Any) -> Callable[[_M], _M]:
    """v1's class decorator `@smp.tp_register(DistributedModule, init_hook=..., forward_hook=...,
    return_hook=...)`: returns the class unchanged (module docstring)."""
    _check_module_class("smp.tp_register", smp_dist_module)

    def register(cls: _M) -> _M:
        _check_module_class("smp.tp_register", cls)
        note_once("smp.tp_register", _WHAT_HERE)
        return cls

    return register


def tp_register_with_module(
    module_cls: type, smp_dist_module: type, init_hook: Callable[..., Any] | None = None, **hooks: Any
) -> None:
    """v1's `smp.tp_register_with_module(module_cls, DistributedModule, init_hook=..., ...)`: accepted,
    changes nothing (module docstring)."""
    _check_module_class("smp.tp_register_with_module", module_cls)
    _check_module_class("smp.tp_register_with_module", smp_dist_module)
    note_once("smp.tp_register_with_module", _WHAT_HERE)
