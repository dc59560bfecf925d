"""`smdistributed.modelparallel.torch` backed by shardpar, for SMP v1 scripts and transformers' SMP branches.

The package ships no `smdistributed/` directory. `shardpar_smdistributed.pth` calls `install()` at
interpreter start-up, which appends `SmdistributedFinder` to the END of `sys.meta_path`: the normal
finders run first, so a real `smdistributed` (AWS's) anywhere on `sys.path` is always the one imported,
and this finder only answers for a name none of them found.

    smdistributed                          an empty package (only when no real one exists)
    smdistributed.modelparallel            `__version__` (transformers reads it), nothing else
    smdistributed.modelparallel.torch      shardpar's `smp` facade, read live (modules.py)
    smdistributed.modelparallel.torch.X.Y  shardpar.X.Y, read live (`nn`, `patches.checkpoint`, ...)

A real `smdistributed` without `modelparallel` (AWS's data-parallel library alone) keeps its own package
and gains only the missing `modelparallel`. This module imports nothing heavy: the `.pth` runs it in every
interpreter, and `importlib.util.find_spec("smdistributed")` (transformers' check) must stay cheap; shardpar
and torch load only when `smdistributed.modelparallel.torch` is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence

ROOT = "smdistributed"
MODELPARALLEL = "smdistributed.modelparallel"
TORCH = "smdistributed.modelparallel.torch"


class _NamespaceLoader(importlib.abc.Loader):
    """`smdistributed` and `smdistributed.modelparallel`: packages whose children come from this finder."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = f"{module.__name__}: provided by shardpar-smdistributed (backed by shardpar)."
        if module.__name__ == MODELPARALLEL:
            from shardpar_smdistributed.version import SMP_API_VERSION

            module.__version__ = SMP_API_VERSION  # type: ignore[attr-defined]


class _ShardparLoader(importlib.abc.Loader):
    """`smdistributed.modelparallel.torch[.X...]`: a module that reads shardpar's `[.X...]` live."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        from shardpar_smdistributed import modules

        modules.fill(module)


class SmdistributedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in (ROOT, MODELPARALLEL):
            return importlib.machinery.ModuleSpec(fullname, _NamespaceLoader(), is_package=True)
        if fullname == TORCH or fullname.startswith(TORCH + "."):
            if fullname != TORCH and not _shardpar_has(shardpar_name(fullname)):
                return None  # v1 submodules shardpar lacks stay a ModuleNotFoundError
            # is_package with no search locations: children come back here, never from shardpar's files
            # through the normal path finder (that would load a second copy of shardpar's modules).
            return importlib.machinery.ModuleSpec(fullname, _ShardparLoader(), is_package=True)
        return None


def shardpar_name(fullname: str) -> str:
    """`smdistributed.modelparallel.torch.nn.huggingface` -> `shardpar.nn.huggingface`."""
    return "shardpar" + fullname[len(TORCH) :]


def _shardpar_has(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent is missing
        return False


def install() -> None:
    """Append the finder to the end of `sys.meta_path` (once): after every real finder."""
    if not any(isinstance(f, SmdistributedFinder) for f in sys.meta_path):
        sys.meta_path.append(SmdistributedFinder())
