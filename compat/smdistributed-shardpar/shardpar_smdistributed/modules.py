"""The contents of `smdistributed.modelparallel.torch[.X...]`: shardpar's own objects, read live.

Each module forwards attribute reads to its shardpar module (`shardpar`, `shardpar.nn`, ...) through a
module `__getattr__` instead of copying names: whatever shardpar has when the attribute is read is what
the v1 script gets, names shardpar gains later included, and `smp.init is shardpar.init`.

Two v1 names transformers' SMP branches read are supplied here only while shardpar lacks them:
`smp.model.DistributedModel` (trainer.py: `isinstance(model, smp.model.DistributedModel)`) and
`smp.state.module_manager.translate_functions` (modeling_utils.py `save_pretrained`, for SMP >= 1.10).
"""

from __future__ import annotations

import importlib
import types
from typing import Any

from shardpar_smdistributed import TORCH, shardpar_name


class _ModuleManager:
    """SMP v1's `state.module_manager`, for `translate_functions`: (smp->hf, hf->smp) state-dict
    translators that v1 registered for its renamed `DistributedTransformer`. shardpar keeps the Hugging
    Face names, so there is nothing to translate."""

    translate_functions: list[tuple[Any, Any]] = []  # read, never written, by transformers


class _StateView:
    """`smp.state`: shardpar's own `smp.state` (`cfg`, ...) plus v1's `module_manager` while shardpar's lacks it."""

    def __init__(self, state: Any) -> None:
        self._state = state
        self.module_manager = _ModuleManager()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


def _fallbacks(shardpar: types.ModuleType) -> dict[str, Any]:
    """v1 names of the torch module that shardpar does not have (yet), built only when read."""
    out: dict[str, Any] = {}
    if not hasattr(shardpar, "model"):
        from shardpar.runtime.model import DistributedModel

        model = types.ModuleType(f"{TORCH}.model", "SMP v1's smp.model: the DistributedModel class.")
        model.DistributedModel = DistributedModel  # type: ignore[attr-defined]
        out["model"] = model
    if not hasattr(shardpar.state, "module_manager"):
        out["state"] = _StateView(shardpar.state)
    return out


def _missing(module: types.ModuleType, target: types.ModuleType, name: str, err: AttributeError) -> AttributeError:
    return AttributeError(
        f"module {module.__name__!r} has no attribute {name!r}: it is {target.__name__}.{name} (shardpar-smdistributed "
        f"forwards every name to shardpar), and shardpar says: {err}. docs/migration.md lists each SMP v1 name with "
        "what shardpar provides instead"
    )


def fill(module: types.ModuleType) -> None:
    """Make `module` (`smdistributed.modelparallel.torch[.X...]`) read `shardpar[.X...]` live."""
    target = importlib.import_module(shardpar_name(module.__name__))
    extra = _fallbacks(target) if module.__name__ == TORCH else {}
    # Replacing `state` must win over shardpar's: put the fallbacks in the module dict itself.
    vars(module).update(extra)

    def __getattr__(name: str) -> Any:
        try:
            return getattr(target, name)
        except AttributeError as err:
            if name.startswith("__"):
                raise
            try:  # a submodule shardpar has not imported yet: `smp.nn.huggingface` before any import of it
                return importlib.import_module(f"{module.__name__}.{name}")
            except ModuleNotFoundError:
                raise _missing(module, target, name, err) from None

    def __dir__() -> list[str]:
        return sorted({*dir(target), *extra})

    public = getattr(target, "__all__", None)
    if public is None:
        public = [n for n in vars(target) if not n.startswith("_")]
    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    module.__dir__ = __dir__  # type: ignore[method-assign]
    module.__all__ = sorted({*public, *extra})  # type: ignore[attr-defined]  # `from ... import *`
    module.__doc__ = f"SMP v1's {module.__name__}, backed by {target.__name__} (shardpar-smdistributed)."
