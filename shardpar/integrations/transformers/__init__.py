"""`from shardpar.integrations.transformers import Trainer`: a drop-in `transformers.Trainer` that
trains a shardpar-sharded model (trainer.py; what it refuses, settings.py)."""

from shardpar.integrations.transformers.settings import ELEMENTWISE_OPTIMIZERS, UnsupportedArguments
from shardpar.integrations.transformers.trainer import Trainer

__all__ = ["ELEMENTWISE_OPTIMIZERS", "Trainer", "UnsupportedArguments"]
