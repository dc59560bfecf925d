"""SMP v1's `smdistributed.modelparallel.torch.patches.checkpoint`: `checkpoint(module, *args,
preserve_rng_state=True)` and `checkpoint_sequential(sequential_module, input, strategy="each",
preserve_rng_state=True, pack_args_as_tuple=False)` (api/activation_checkpointing.py)."""

from shardpar.api.activation_checkpointing import checkpoint_call as checkpoint
from shardpar.api.activation_checkpointing import checkpoint_sequential

__all__ = ["checkpoint", "checkpoint_sequential"]
