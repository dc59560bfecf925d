"""Splitting a model into units and assigning every parameter an owner (pure module walking).

Default units: each child of a repeated `nn.ModuleList` (HF `model.layers`, `gpt_neox.layers`,
`transformer.h`, ...), outermost lists only; each large module outside them ([Note: large modules
outside the blocks]); and the root for everything else. `wrap` overrides the choice with module
classes (a class list that matches nothing is an error) or a predicate.

[Note: large modules outside the blocks]
The root unit stays gathered from the start of forward to the end of backward: its parameters are
used at both ends of the pass (embeddings first, the LM head last) and the root's forward spans the
whole model. With untied input and output embeddings that is 2 x vocab x hidden elements (77M of a
162M-parameter GPT-NeoX, 206M of a 1B one) alive through the whole step on top of every unit that
computes, beside the sharded state, and dominating the peak (issue 19). So with the default units,
a module outside the blocks that itself holds at least OWN_UNIT_NUMEL parameter elements (an
`nn.Embedding`, an LM head) becomes a unit of its own and is gathered only around its own forward
and backward, like a block. Smaller modules (final layer norm, biases: below the default
sdp_param_persistence_threshold they are not even sharded) stay in the root. A module whose parameter
another module also uses (tied input and output embeddings) stays in the root too: both users would
hold it anyway, and the root is what keeps it alive between them.
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


# Parameter elements a module outside the blocks holds itself to become a unit of its own
# ([Note: large modules outside the blocks]); the default sdp_param_persistence_threshold.
OWN_UNIT_NUMEL = 1_000_000


def choose_unit_modules(root: nn.Module, wrap: WrapPolicy) -> list[tuple[str, nn.Module]]:
    """(FQN, module) of every non-root unit, outermost first, in module order."""
    if wrap is None:
        lists = [(n, m) for n, m in root.named_modules() if _is_repeated_list(m)]
        outer = [(n, m) for n, m in lists if not any(n.startswith(o + ".") for o, _ in lists if o != n)]
        blocks = [(f"{n}.{i}", c) for n, m in outer for i, c in enumerate(m.children())]
        if not blocks:
            return []
        order = {id(m): i for i, (_, m) in enumerate(root.named_modules())}
        return sorted(blocks + _large_modules_outside(root, blocks), key=lambda nm: order[id(nm[1])])
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


def _large_modules_outside(root: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Modules outside and around no block that hold >= OWN_UNIT_NUMEL parameter elements themselves,
    none of them shared with another module ([Note: large modules outside the blocks])."""
    uses: Counter[int] = Counter(id(p) for m in root.modules() for p in m.parameters(recurse=False))
    taken = [n for n, _ in blocks]
    found: list[tuple[str, nn.Module]] = []
    for name, m in root.named_modules():
        if m is root or any(name == t or name.startswith(t + ".") or t.startswith(name + ".") for t in taken):
            continue  # in a block or a chosen module, or around one
        own = list(m.parameters(recurse=False))
        if sum(p.numel() for p in own) >= OWN_UNIT_NUMEL and all(uses[id(p)] == 1 for p in own):
            found.append((name, m))
            taken.append(name)
    return found


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
