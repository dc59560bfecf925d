"""`smp.tensor_parallelism()`: remember which modules were built inside the context, and turn that
(or `DistributedModel(..., tensor_parallelism=True)`) into a conversion when the model is wrapped.

As in SageMaker model parallelism v1, the context only marks; `smp.DistributedModel` converts. A
module's mark comes from the innermost context active when it was first registered (its own
construction registers its children, its parent's registers it), so

    with smp.tensor_parallelism():
        model = AutoModelForCausalLM.from_config(cfg)        # every block split
        with smp.tensor_parallelism(enabled=False):
            model.extra = Block(cfg)                         # stays replicated

A module without a mark inherits its parent's. The one `ModuleMarks` instance lives in the facade
(api.py), the only process-wide state.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.nn.modules import module as module_hooks

from shardpar.collectives import Engine
from shardpar.tensor_parallel.comm import TPComm
from shardpar.tensor_parallel.hf import convert_hf_model
from shardpar.tensor_parallel.layers import TPLayer
from shardpar.topology import Topology


@dataclass(frozen=True)
class TPOptions:
    enabled: bool = True
    # LM head returns vocab-parallel logits and the loss is the vocab-parallel cross-entropy
    vocab_parallel_loss: bool = False


class ModuleMarks:
    def __init__(self) -> None:
        self._marks: weakref.WeakKeyDictionary[nn.Module, TPOptions] = weakref.WeakKeyDictionary()
        self._stack: list[TPOptions] = []
        self._handle: Any = None

    @contextlib.contextmanager
    def building(self, options: TPOptions) -> Iterator[None]:
        self._stack.append(options)
        if self._handle is None:
            self._handle = module_hooks.register_module_module_registration_hook(self._on_register)
        try:
            yield
        finally:
            self._stack.pop()
            if not self._stack and self._handle is not None:
                self._handle.remove()
                self._handle = None

    def _on_register(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        options = self._stack[-1]
        for m in (parent, child):
            if m is not None and m not in self._marks:
                self._marks[m] = options

    def set(self, module: nn.Module, options: TPOptions) -> None:
        """Mark an existing module (`smp.set_tensor_parallelism`): enabling marks `module`, so its
        unmarked descendants follow it; disabling marks its whole subtree, context marks included."""
        for m in module.modules() if not options.enabled else (module,):
            self._marks[m] = options

    def resolve(self, root: nn.Module, default: TPOptions | None) -> dict[int, TPOptions | None]:
        """id(module) -> the options that apply to it (its own mark, else its parent's, else `default`)."""
        out: dict[int, TPOptions | None] = {}
        todo: list[tuple[nn.Module, TPOptions | None]] = [(root, default)]
        while todo:
            module, inherited = todo.pop()
            options = self._marks.get(module, inherited)
            out[id(module)] = options
            todo.extend((child, options) for child in module.children())
        return out


def prepare_model(
    module: nn.Module,
    *,
    requested: bool,
    marks: ModuleMarks,
    topology: Topology,
    engine: Engine,
) -> nn.Module:
    """Convert `module` in place when tensor parallelism was asked for (kwarg or context); called by
    `smp.DistributedModel` before sharding, so each TP rank shards its local parameters."""
    options = marks.resolve(module, TPOptions() if requested else None)
    tp = topology.tp.size
    converted = [m for m in module.modules() if isinstance(m, TPLayer)]
    if converted:  # by convert_hf_model already; a second conversion would split the split weights
        if converted[0].comm.size != tp:
            raise ValueError(
                f"the model was converted for a TP group of {converted[0].comm.size} ranks, but "
                f"tensor_parallel_degree={tp}; convert it with TPComm over smp.get_topology().tp"
            )
        return module
    if not any(o is not None and o.enabled for o in options.values()):
        if tp > 1:
            warnings.warn(
                f"tensor_parallel_degree={tp} but the model is not tensor parallel: every TP rank holds whole "
                "layers. Pass smp.DistributedModel(model, tensor_parallelism=True) or build the model under "
                "smp.tensor_parallelism()",
                stacklevel=3,
            )
        return module
    if tp == 1:
        return module

    def include(m: nn.Module) -> bool:
        o = options.get(id(m))
        return o is not None and o.enabled

    get_head: Any = getattr(module, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    head_options = options.get(id(head)) if head is not None else None
    comm = TPComm(engine, topology.tp, topology.coords.tp_rank)
    return convert_hf_model(
        module,
        comm,
        vocab_parallel_loss=bool(head_options and head_options.enabled and head_options.vocab_parallel_loss),
        include=include,
    )
