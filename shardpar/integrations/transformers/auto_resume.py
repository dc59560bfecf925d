"""Automatic resume under the Trainer: a run that torchrun restarted continues from its newest checkpoint.

transformers resumes only when told (`train(resume_from_checkpoint=True)`); a plain re-run starts over,
and that stays so. What changes is a *restart*: torchrun --max-restarts starts the same script again
after a rank died (TORCHELASTIC_RESTART_COUNT > 0), where nobody can pass the argument, so the newest
`checkpoint-N` of `output_dir` is loaded as `resume_from_checkpoint=True` would load it (model shards,
optimizer, scheduler, trainer state, RNG, the data position). `Trainer(..., shardpar_auto_resume=False)`
opts out.
"""

from __future__ import annotations

import os

from transformers.trainer_utils import get_last_checkpoint


def restart_count() -> int:
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def checkpoint_to_resume(output_dir: str | None) -> str | None:
    """The newest checkpoint-N of `output_dir` when this start is a torchrun restart; else None.
    Every rank gets the same answer (the same environment, the same shared output_dir)."""
    if restart_count() == 0 or not output_dir or not os.path.isdir(output_dir):
        return None
    return get_last_checkpoint(output_dir)
