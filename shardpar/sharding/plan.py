"""Splitting a model into units and assigning every parameter an owner (pure module walking).

Default units: each child of a repeated `nn.ModuleList` (HF `model.layers`, `gpt_neox.layers`,
`transformer.h`, ...), outermost lists only, plus the root for everything else. `wrap` overrides
the choice with module classes (a class list that matches nothing is an error) or a predicate.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import nn

# module classes (one class means [cls]), or a predicate over modules; None: the default units
WrapPolicy = Iterable[type[nn.Module]] | type[nn.Module] | Callable[[nn.Module], bool] | None


@dataclass
class UnitPlan:
    name: str  # module FQN ("" for the root)
    module: nn.Module
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)  # owned, in registration order
    # parameters owned by another unit but used by this unit's modules (tied weights)
    borrowed: list[nn.Parameter] = field(default_factory=list)


# The class attribute naming the original class of a module whose class smp.set_activation_checkpointing
# swapped for a subclass that only checkpoints its __call__ (api/activation_checkpointing.py).
CHECKPOINTED_BASE = "_shardpar_checkpointed_base"


def built_class(m: nn.Module) -> type:
    """The class `m` was built as, before any activation-checkpointing class swap."""
    cls = type(m)
    base = cls.__dict__.get(CHECKPOINTED_BASE)
    return base if isinstance(base, type) else cls


def _is_repeated_list(m: nn.Module) -> bool:
    children = list(m.children())
    return (
        isinstance(m, nn.ModuleList)
        and len(children) >= 2
        and len({built_class(c) for c in children}) == 1
        and any(True for _ in m.parameters())
    )


def _class_predicate(root: nn.Module, wrap: object) -> Callable[[nn.Module], bool]:
    """isinstance over the classes of `wrap`, checked to match at least one module below the root."""
    classes = (wrap,) if isinstance(wrap, type) or not isinstance(wrap, Iterable) else tuple(wrap)
    if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(
            f"wrap must be module classes or a predicate, got {wrap!r}; "
            "pass nn.Module subclasses such as [MyBlock], or a function (module) -> bool"
        )
    if not any(isinstance(m, classes) for m in root.modules() if m is not root):
        # Only the root unit would be left, gathering the whole model at once: no sharding at all.
        present = Counter(type(m).__name__ for m in root.modules() if m is not root)  # first-seen order
        shown = ", ".join(f"{name} x{n}" for name, n in list(present.items())[:8])
        more = f" and {len(present) - 8} more types" if len(present) > 8 else ""
        raise ValueError(
            f"wrap={[c.__name__ for c in classes]} matches no module below the root {type(root).__name__} "
            f"(its modules: {shown or 'none'}{more}); name the class of the repeated block to shard as a "
            "unit, or leave wrap=None for the default units"
        )
    return lambda m: isinstance(m, classes)


def choose_unit_modules(root: nn.Module, wrap: WrapPolicy) -> list[tuple[str, nn.Module]]:
    """(FQN, module) of every non-root unit, outermost first, in module order."""
    if wrap is None:
        lists = [(n, m) for n, m in root.named_modules() if _is_repeated_list(m)]
        outer = [(n, m) for n, m in lists if not any(n.startswith(o + ".") for o, _ in lists if o != n)]
        return [(f"{n}.{i}", c) for n, m in outer for i, c in enumerate(m.children())]
    # A class is callable too, but it means [cls]: calling it as a predicate would build a module.
    predicate = wrap if callable(wrap) and not isinstance(wrap, (type, Iterable)) else _class_predicate(root, wrap)
    chosen: list[tuple[str, nn.Module]] = []
    for name, m in root.named_modules():
        if m is root or not predicate(m):
            continue
        if any(name.startswith(c + ".") for c, _ in chosen):
            continue  # nested inside a chosen unit: part of it
        chosen.append((name, m))
    return chosen


def plan_units(root: nn.Module, wrap: WrapPolicy) -> list[UnitPlan]:
    """Units in forward order (root first); each parameter owned by exactly one unit."""
    units = [UnitPlan("", root)] + [UnitPlan(n, m) for n, m in choose_unit_modules(root, wrap)]
    prefixes = [(u.name + ".", u) for u in units[1:]]

    def unit_of(fqn: str) -> UnitPlan:
        best = units[0]
        for prefix, u in prefixes:
            if fqn.startswith(prefix) and len(prefix) > len(best.name) + 1:
                best = u
        return best

    owner: dict[int, UnitPlan] = {}
    for fqn, p in root.named_parameters(remove_duplicate=False):
        u = unit_of(fqn)
        if id(p) not in owner:
            owner[id(p)] = u
            u.params.append((fqn, p))
        elif owner[id(p)] is not u and all(q is not p for q in u.borrowed):
            u.borrowed.append(p)
    return units
