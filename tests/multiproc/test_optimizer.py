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
