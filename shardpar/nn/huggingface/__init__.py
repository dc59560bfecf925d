"""SageMaker model-parallel v1's Hugging Face state-dict translations, one module per model family.

v1 replaced HF blocks by its DistributedTransformer, whose parameters had other names, so scripts
translated checkpoints both ways. shardpar keeps the model's own modules and names (tensor
parallelism included: `model.state_dict()` and checkpoints use HF names), so each translation is the
identity: the functions exist so that v1 scripts run unchanged, and they return a new dict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def identity_translation(direction: str, family: str) -> Callable[..., dict[str, Any]]:
    def translate(state_dict: Mapping[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{translate.__name__} takes a state dict (a mapping), got {type(state_dict).__name__}")
        return dict(state_dict)

    translate.__name__ = (
        f"translate_hf_state_dict_to_smdistributed_{family}"
        if direction == "to_smp"
        else f"translate_state_dict_to_hf_{family}"
    )
    translate.__doc__ = (
        f"v1's {translate.__name__}(state_dict, *args, **kwargs): a copy of `state_dict`, unchanged -- shardpar's "
        f"{family} parameters keep their Hugging Face names (extra v1 arguments such as max_seq_len are accepted)."
    )
    return translate
