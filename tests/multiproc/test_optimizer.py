"""DistributedOptimizer.step() against the model's accumulation window."""

from __future__ import annotations

from tests.multiproc import optimizer_cases as cases


def test_step_inside_accumulation_window_is_refused_before_anything_changes(ranks) -> None:
    for rank, res in enumerate(ranks.run(2, cases.step_mid_window_case)):
        message = res["error"]
        assert "backward_passes_per_step=3" in message and "2 of the 3 backward passes" in message, (
            f"rank {rank}: {message}"
        )
        assert "after every 3 backward passes" in message and "lower backward_passes_per_step" in message, message
        assert res["untouched"] and res["collectives"] == 0, f"rank {rank}: the refused step changed something"
        assert res["stepped_after"], f"rank {rank}: the completed window did not step"


def test_step_after_part_of_a_micro_batched_window_is_refused(ranks) -> None:
    for res in ranks.run(2, cases.step_mid_window_microbatches_case):
        assert "after 2 of the 4 backward passes" in res["error"], res["error"]
        assert "(backward_passes_per_step=2 x 2 micro-batches)" in res["error"], res["error"]
        assert res["replicas_differ"] == 0.0
