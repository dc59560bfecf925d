"""Which optimizers DistributedOptimizer can step exactly on this rank's pieces ([Note: how the
optimizer sees the shards] in optimizer.py).

  element-wise (torch.optim's SGD, Adam, AdamW, ...): every update element depends only on the same
      element of the parameter, its gradient and its state -> plain 1-D pieces, full speed;
  shape-aware ones we know (Adafactor's row/column statistics, Shampoo/SOAP preconditioners, Muon's
      orthogonalisation, GaLore projections, bitsandbytes' block-quantized state): their maths needs
      the whole parameter, which no rank holds -> refused at construction, naming what to use;
  anything else: stepped on the global-shape user parameters, where element-wise maths and whole-tensor
      norms are exact (LAMB, LARS, Lion, ...) and any other op raises before it computes.
"""

from __future__ import annotations

import torch

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

# Class names (any class in the optimizer's MRO) -> why the maths needs whole parameters.
_SHAPE_AWARE = {
    "Adafactor": "factors its second moment into row and column statistics of each weight matrix",
    "Shampoo": "preconditions each weight with matrices built from its full shape",
    "DistributedShampoo": "preconditions each weight with matrices built from its full shape",
    "SOAP": "preconditions each weight with matrices built from its full shape",
    "Muon": "orthogonalises each weight's update as a whole matrix (Newton-Schulz)",
    "GaLoreAdamW": "projects each weight's gradient onto a low-rank basis of the whole matrix",
    "GaLoreAdafactor": "projects each weight's gradient onto a low-rank basis of the whole matrix",
    "Adam8bit": "quantizes its state in blocks laid over the whole flattened tensor",
    "AdamW8bit": "quantizes its state in blocks laid over the whole flattened tensor",
    "PagedAdam8bit": "quantizes its state in blocks laid over the whole flattened tensor",
    "PagedAdamW8bit": "quantizes its state in blocks laid over the whole flattened tensor",
    "Lion8bit": "quantizes its state in blocks laid over the whole flattened tensor",
    "SGD8bit": "quantizes its state in blocks laid over the whole flattened tensor",
}

_INSTEAD = (
    "use an element-wise optimizer (torch.optim.AdamW, Adam, SGD, ...), or one whose only whole-tensor maths "
    "is a norm (LAMB, LARS, Lion), which DistributedOptimizer steps exactly"
)


def check_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """True: element-wise, step plain pieces. False: step the user parameters. Raises ValueError for a
    shape-aware optimizer whose maths would silently differ on pieces."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"smp.DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    for cls in type(optimizer).__mro__:
        why = _SHAPE_AWARE.get(cls.__name__)
        if why is not None:
            raise ValueError(
                f"{type(optimizer).__module__}.{type(optimizer).__name__} cannot be sharded exactly: it {why}, and "
                f"with sharded data parallelism each rank holds only a piece of every parameter; {_INSTEAD}"
            )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "torch.optim.LBFGS needs a closure that re-evaluates the model, which DistributedOptimizer.step "
            f"does not take; {_INSTEAD}"
        )
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise ValueError(f"torch.optim.SparseAdam needs sparse gradients; shardpar's are dense. {_INSTEAD}")
    # Exactly these classes: a subclass may override step() with other maths.
    return type(optimizer) in _ELEMENTWISE
