"""How DistributedOptimizer steps an optimizer ([Note: how the optimizer sees the shards] in
optimizer.py):

  element-wise (torch.optim's SGD, Adam, AdamW, ...): every update element depends only on the same
      element of the parameter, its gradient and its state -> plain 1-D pieces of this rank's shards,
      full speed, no communication;
  anything else (Muon, Adafactor, Shampoo/SOAP, bitsandbytes' 8-bit, LAMB, an optimizer we have never
      seen): each sharded parameter stepped whole on one owner rank ([Note: owner compute] in
      owner_compute.py) -- exact for any maths, at the cost of an all_to_all each way;
  LBFGS (needs a closure) and SparseAdam (needs sparse gradients): refused.
"""

from __future__ import annotations

import torch

from shardpar.optim.ownership import kind_of

_ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
)

_INSTEAD = "use any other torch.optim optimizer: element-wise ones step pieces, all others step whole parameters"


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse what cannot run under DistributedOptimizer at all (TypeError / ValueError)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"smp.DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "torch.optim.LBFGS needs a closure that re-evaluates the model, which DistributedOptimizer.step "
            f"does not take; {_INSTEAD}"
        )
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise ValueError(f"torch.optim.SparseAdam needs sparse gradients; shardpar's are dense. {_INSTEAD}")


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Exactly these classes: a subclass may override step() with other maths, and an unknown class is
    stepped whole on an owner, which is exact for any optimizer."""
    return type(optimizer) in _ELEMENTWISE


def owner_kind(optimizer: torch.optim.Optimizer) -> str:
    """The cost model ownership.py balances an owner-stepped optimizer's parameters by."""
    return kind_of(type(optimizer).__name__)
