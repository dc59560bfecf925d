"""recipes/train_causal_lm.py as torchrun starts it, except that on the first attempt
(TORCHELASTIC_RESTART_COUNT 0) rank SHARDPAR_TEST_KILL_RANK kills itself with SIGKILL -- kill -9, no
handler, no cleanup -- when it starts training step SHARDPAR_TEST_KILL_STEP (1-based). The restarted
attempt runs unharmed. Used by test_auto_resume.py."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: recipes, shardpar

from recipes import train_causal_lm
from recipes.causal_lm import train


def arm(rank: int, at_step: int) -> None:
    original, calls = train._train_step, []

    def step_or_die(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and len(calls) == at_step and int(os.environ["RANK"]) == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    train._train_step = step_or_die  # type: ignore[assignment]


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank's stacks, for whoever debugs it
    arm(int(os.environ["SHARDPAR_TEST_KILL_RANK"]), int(os.environ["SHARDPAR_TEST_KILL_STEP"]))
    raise SystemExit(train_causal_lm.main(sys.argv[1:]))
