"""Frozen parameters (issue 33): PEFT LoRA training against single-process PEFT, and what a frozen
base costs a rank -- gathered memory in backward, measured from outside as test_memory.py does."""

from __future__ import annotations

import pytest

from tests.multiproc import frozen_cases as cases
from tests.multiproc.test_memory import ENV, GLOO_TEMP_BLOCKS, SLACK


@pytest.mark.parametrize("checkpoint", [None, False, True], ids=["plain", "ckpt", "ckpt-reentrant"])
def test_frozen_units_are_freed_once_their_backward_ran(ranks, checkpoint: bool | None) -> None:
    """Item 0: every block unit holds only frozen weights (its LoRA adapters are persistent). Each is
    freed once its backward ran, so the live cap (one block) holds through backward, and the rank's
    RSS in backward stays at a block and gloo's temporary -- before, all six blocks stayed gathered to
    the end of backward (6 x 33.6 MB above the step's start)."""
    for r in ranks.run(2, cases.lora_rss_case, checkpoint, env=ENV, timeout=300):
        block = r["block_bytes"]
        assert r["max_live"] <= r["block"], r  # the root holds nothing sharded: the cap alone
        assert all(n >= 5 for n in r["freed_in_backward"]), r  # 5 of 6 blocks freed before the last gather
        for peak in r["backward_peaks"]:
            # the block that computes and gloo's temporary; the adapters' grads and activations are small
            assert peak <= (1 + GLOO_TEMP_BLOCKS) * block + SLACK, r
        assert r["loss_diff"] <= 1e-5, r
        assert r["adapter_diff"] <= 5e-5 and r["param_diff"] <= 5e-5, r
