"""OptimizerList: several torch optimizers stepped as one, for recipes that pair optimizers.

torch.optim.Muon takes 2-D weight matrices only; its documentation steps embeddings, norms, biases
and the head with AdamW, i.e. two optimizers. `smp.DistributedOptimizer([muon, adamw])` wraps both
in one object: one `step()` (one grad norm, one clip, one skip decision for both, as one
`clip_grad_norm_` over all parameters would give), one `zero_grad()`, one LR scheduler over all param
groups. Each optimizer keeps its own kind: AdamW steps pieces, Muon whole parameters on owners.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import torch


class OptimizerList(torch.optim.Optimizer):
    """`Optimizer.__init__` is not called: the groups and state are the inner optimizers'."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ValueError("smp.DistributedOptimizer([]): pass at least one torch.optim optimizer")
        for o in optimizers:
            if not isinstance(o, torch.optim.Optimizer):
                raise TypeError(f"smp.DistributedOptimizer wraps torch.optim optimizers, got {type(o).__name__}")
        seen: set[int] = set()
        for o in optimizers:
            for g in o.param_groups:
                for p in g["params"]:
                    if id(p) in seen:
                        raise ValueError(
                            f"a parameter of shape {tuple(p.shape)} is in two of the optimizers passed to "
                            "smp.DistributedOptimizer; give each parameter to one optimizer"
                        )
                    seen.add(id(p))
        self.optimizers = list(optimizers)
        self._state = _JointState(self.optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizers[0].defaults

    def step(self, closure: Any = None) -> Any:
        for o in self.optimizers:
            o.step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("optimizers")
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            got = len(saved) if isinstance(saved, list) else "no"
            raise ValueError(
                f"load_state_dict: {got} optimizers' states for {len(self.optimizers)} optimizers; load the "
                "state_dict() of the same list of optimizers"
            )
        for o, s in zip(self.optimizers, saved, strict=True):
            o.load_state_dict(s)

    def __repr__(self) -> str:
        return f"OptimizerList({', '.join(type(o).__name__ for o in self.optimizers)})"


class _JointState(MutableMapping[Any, Any]):
    """The inner optimizers' state as one mapping: a parameter's entry lives in its optimizer's."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers

    def _of(self, p: Any) -> torch.optim.Optimizer:
        for o in self._optimizers:
            if any(q is p for g in o.param_groups for q in g["params"]):
                return o
        raise KeyError(p)

    def __getitem__(self, p: Any) -> Any:
        for o in self._optimizers:
            if p in o.state:
                return o.state[p]
        raise KeyError(p)

    def __setitem__(self, p: Any, value: Any) -> None:
        self._of(p).state[p] = value

    def __delitem__(self, p: Any) -> None:
        for o in self._optimizers:
            if p in o.state:
                del o.state[p]
                return
        raise KeyError(p)

    def __iter__(self) -> Iterator[Any]:
        for o in self._optimizers:
            yield from o.state

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._optimizers)

    def clear(self) -> None:
        for o in self._optimizers:
            o.state.clear()
