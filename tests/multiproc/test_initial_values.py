"""Issue 29 item 2: every rank starts from rank 0's initial weights, as with DDP, however the ranks were
seeded ([Note: rank 0's initial values], runtime/initial_values.py)."""

from __future__ import annotations

import pytest

from tests.multiproc import initial_values_cases as cases


@pytest.mark.parametrize("threshold", [0, 1_000_000], ids=["sharded", "kept-whole"])
def test_ranks_seeded_apart_start_from_rank_0s_weights_as_with_ddp(ranks, threshold: int) -> None:
    """Exact in fp32: the wrapped model equals DDP's after wrapping and after three SGD steps."""
    for rank, r in enumerate(ranks.run(2, cases.ddp_case, threshold)):
        assert r["at_wrap"] == 0.0 and r["rank0_model"] == 0.0, (rank, r)
        assert rank == 0 or r["own_model"] > 0.0, "the ranks were not seeded apart: nothing is tested"
        assert (r["num_sharded"] > 0) == (threshold == 0) and (r["num_whole"] > 0) == (threshold > 0), r
        assert r["loss"] == 0.0 and r["param"] == 0.0, (rank, r)


@pytest.mark.parametrize("same_seed", [False, True], ids=["seeded-apart", "seeded-alike"])
def test_delayed_initialization_gives_rank_0s_single_process_values(ranks, same_seed: bool) -> None:
    for rank, r in enumerate(ranks.run(2, cases.delayed_case, same_seed)):
        assert r["rank0_model"] == 0.0, (rank, r)
        # Alike: each rank replays its own record (no traffic); apart: one broadcast per parameter.
        assert r["broadcasts"] == (0 if same_seed else r["num_params"]), (rank, r)


@pytest.mark.parametrize("delayed", [False, True], ids=["built", "delayed"])
def test_tensor_parallel_ranks_seeded_apart_hold_rank_0s_model_split(ranks, delayed: bool) -> None:
    for rank, r in enumerate(ranks.run(4, cases.tp_case, delayed, timeout=300)):
        assert r["rank0_model"] == 0.0, (rank, r)
