"""Frozen parameters (issue 33): PEFT LoRA training against single-process PEFT, and what a frozen
base costs a rank -- gathered memory in backward, measured from outside as test_memory.py does."""

from __future__ import annotations

import pytest

from tests.multiproc import frozen_cases as cases
from tests.multiproc.test_memory import ENV, GLOO_TEMP_BLOCKS, SLACK


@pytest.mark.parametrize("checkpoint", [None, False, True], ids=["plain", "ckpt", "ckpt-reentrant"])
def test_frozen_units_are_freed_once_their_backward_ran(ranks, checkpoint: bool | None) -> None:
    """Item 0: every block unit holds only frozen weights (its LoRA adapters are persistent). Each is
    freed once its backward ran, so the live cap (the gathered root and one block) holds through
    backward, and the rank's RSS in backward stays at a block and gloo's temporary -- before, all six
    blocks stayed gathered to the end of backward (6 x 33.6 MB above the step's start). The blocks hold
    their biases since only trained parameters persist: 33.6 MB, just over gloo's former 32 MiB gather
    chunk, whose temporary made the peak two blocks ([Note: gloo's gather temporary], native.py)."""
    for r in ranks.run(2, cases.lora_rss_case, checkpoint, env=ENV, timeout=300):
        block = r["block_bytes"]
        assert r["max_live"] <= r["cap"], r  # the root and one block (the cap): never two blocks
        assert r["max_live"] > r["block"], r
        assert all(n >= 5 for n in r["freed_in_backward"]), r  # 5 of 6 blocks freed before the last gather
        for peak in r["backward_peaks"]:
            # the block that computes and gloo's temporary; the adapters' grads and activations are small
            assert peak <= (1 + GLOO_TEMP_BLOCKS) * block + SLACK, r
        assert r["loss_diff"] <= 1e-5, r
        assert r["adapter_diff"] <= 5e-5 and r["param_diff"] <= 5e-5, r


SAVE_SDP2 = {"sharded_data_parallel_degree": 2}
SAVE_REPLICAS = {"sharded_data_parallel_degree": 1, "shard_optimizer_state": True}  # 2 replicas, pieces


@pytest.mark.parametrize(("save", "sdp"), [(SAVE_SDP2, 1), (SAVE_REPLICAS, 2)], ids=["sdp2-to-1", "replicas-to-sdp2"])
def test_frozen_base_keeps_only_a_shard_in_its_dtype_and_checkpoints(ranks, tmp_path, save, sdp: int) -> None:
    """Item 1: a bf16 base frozen at wrap time is one bf16 shard per unit (2 bytes / parameter / sdp):
    no fp32 main copy, no main grad, no bucket, no optimizer state. Partial checkpoints resume under
    another sdp (resharding) bit for bit, the base comes back unchanged, and a requires_grad flipped
    after wrapping is refused at the next forward."""
    shards = save["sharded_data_parallel_degree"]
    for r in ranks.run(2, cases.frozen_state_case, str(tmp_path), save, sdp):
        assert r["frozen_dtypes"] == ["torch.bfloat16"], r
        # this rank's 1/sdp of every frozen weight (a few elements of padding per unit), on every replica
        assert r["frozen_numel"] // shards <= r["frozen_shard_numel"] <= r["frozen_numel"] // shards + 8, r
        assert r["main_numel"] == 0 and r["main_grad_numel"] == 0 and r["bucket_units"] == [], r
        assert r["optimizer_state_params"] == r["trainable_params"] > 0, r  # the adapters only
        assert r["resume_diff"] == 0.0 and r["base_diff"] == 0.0, r
        assert r["refused"] is not None and "requires_grad was set to True after" in r["refused"], r
