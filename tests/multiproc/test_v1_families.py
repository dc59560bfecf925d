"""Done-when of issue 30: GPT-J and Flan-T5 scripts written the way AWS's v1 templates are (tuple-returning
`@smp.step`, partial checkpoints) train at tp 2 x sdp 2 and at sdp 2 on 4 ranks, and a fresh run resumed
from the step-2 checkpoint repeats the straight run's steps 3-4 exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc import v1_families_cases as cases


@pytest.mark.parametrize("family", sorted(cases.FAMILIES))
def test_v1_template_family_trains_checkpoints_and_resumes_exactly(ranks, tmp_path: Path, family: str) -> None:
    for tp, sdp in ((2, 2), (1, 2)):
        root = str(tmp_path / f"tp{tp}-sdp{sdp}")
        straight = ranks.run(4, cases.run, family, tp, sdp, root, [0, 1, 2, 3], save_at=2)
        resumed = ranks.run(4, cases.run, family, tp, sdp, root, [2, 3], resume=True)
        # v1's reduce_mean averages this rank's micro-batches: each data-parallel rank its own rows' loss,
        # the same on the ranks of one TP group
        for rank in range(4):
            assert resumed[rank] == straight[rank][2:], (tp, sdp, rank, resumed[rank], straight[rank])
            assert straight[rank] == straight[rank - rank % tp], (rank, straight)
            # tokens summed over the micro-batches of this data-parallel rank's rows
            assert all(t == 16 * cases.GLOBAL_BATCH // (4 // tp) for _, t in straight[rank]), straight[rank]
