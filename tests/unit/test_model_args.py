"""DistributedModel's own arguments, checked before the model touches the topology or the engine."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from shardpar.runtime.model import DistributedModel


@pytest.mark.parametrize("k", [0, 1.5, 2.0, True, "2"])
def test_backward_passes_per_step_must_be_a_positive_integer(k: Any) -> None:
    with pytest.raises(ValueError, match=rf"backward_passes_per_step={k!r} must be an integer >= 1"):
        DistributedModel(nn.Linear(2, 2), config=None, topology=None, engine=None, backward_passes_per_step=k)  # type: ignore[arg-type]
