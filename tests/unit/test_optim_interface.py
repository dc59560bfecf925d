"""optim/ meets the sharded state through one interface (shardpar/optim/sharded_state.py, OptimizerState;
[Note: the optimizer's one interface] in docs/design.md): no other optim module reaches into the runtime.

An AST scan of every module of shardpar/optim but the interface, for what would be a reach-in:

    import       anything from shardpar.runtime (the interface re-exports the types optim/ names)
    private      `x._name` on anything but `self` / `cls` (another object's private attribute)
    model        `model.<attr>` / `<...>.model.<attr>`: the DistributedModel's fields, read past the interface
    state        `<...>.sharded_state.<attr>` / `<...>.sharded.<attr>`: the runtime's ShardedState, ditto

ALLOWED lists what must remain, each with its reason; the scanner is checked against a sample of each
kind of reach-in, so this test can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

OPTIM = Path(__file__).resolve().parents[2] / "shardpar" / "optim"
INTERFACE = "sharded_state.py"
RUNTIME_OBJECTS = ("model", "sharded_state", "sharded")

# (file, finding) -> why it stays. The DistributedModel is the constructor's argument: optimizer.py
# names its type and hands it to the interface.
ALLOWED: dict[tuple[str, str], str] = {
    ("optimizer.py", "import shardpar.runtime.model.DistributedModel"): "the type of the constructor's model",
}


def reach_ins(source: str) -> list[str]:
    """Every reach-in of `source` (one optim module), one line each: '<kind> <what>'."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardpar.runtime"):
            found += [f"import {node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.startswith("shardpar.runtime")]
        elif isinstance(node, ast.Attribute):
            base = node.value
            base_name = (
                base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
            )
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            if private and not (isinstance(base, ast.Name) and base.id in ("self", "cls")):
                found.append(f"private {ast.unparse(node)}")
            elif base_name in RUNTIME_OBJECTS:
                found.append(f"{'model' if base_name == 'model' else 'state'} {ast.unparse(node)}")
    return found


def scan() -> dict[str, list[str]]:
    return {path.name: reach_ins(path.read_text()) for path in sorted(OPTIM.glob("*.py")) if path.name != INTERFACE}


def test_optim_reaches_the_runtime_through_the_interface_only() -> None:
    left = [
        f"shardpar/optim/{name}: {what}"
        for name, found in scan().items()
        for what in found
        if (name, what) not in ALLOWED
    ]
    assert not left, (
        "optim/ reaches into the runtime past OptimizerState (shardpar/optim/sharded_state.py); add what it "
        "needs to the interface and call that instead:\n  " + "\n  ".join(left)
    )


def test_every_allowed_reach_in_is_still_there() -> None:
    """An allow-list entry nothing needs any more goes, so the list stays the list of what remains."""
    found = {(name, what) for name, whats in scan().items() for what in whats}
    assert not set(ALLOWED) - found, sorted(set(ALLOWED) - found)


def test_the_scan_finds_each_kind_of_reach_in() -> None:
    sample = """
from shardpar.runtime.unit import Unit
import shardpar.runtime.window
def f(self, model, other):
    self._mine            # own private state: fine
    other._units          # another object's private attribute
    model.window.reset()  # the model's fields
    self.model.units      # through an attribute named model
    self.sharded_state.pieces
    self.view.sharded.grad_blocks()
    self.view.pieces      # the interface: fine
"""
    assert sorted(reach_ins(sample)) == sorted(
        [
            "import shardpar.runtime.unit.Unit",
            "import shardpar.runtime.window",
            "private other._units",
            "model model.window",
            "model self.model.units",
            "state self.sharded_state.pieces",
            "state self.view.sharded.grad_blocks",
        ]
    )
