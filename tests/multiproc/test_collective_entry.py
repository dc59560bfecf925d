"""A gathering call made on some ranks only raises there, naming the fix, before any rank sends a byte
([Note: collective entry], collectives/entry.py): issue 30 item 6, transformers' rank-0-only
save_pretrained."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.multiproc.entry_cases import rank0_only_gathers

pytest.importorskip("transformers")


def test_rank0_only_save_pretrained_and_state_dict_raise_with_the_fix(ranks, tmp_path: Path) -> None:
    results = ranks.run(4, rank0_only_gathers, str(tmp_path), timeout=300)
    assert "model.safetensors" in results[0]["every_rank"], results[0]
    assert all("model.safetensors" in r["given_state_dict"] for r in results), results  # no collective
    assert not (tmp_path / "rank0_only").exists()  # rank 0 raised before gathering anything
    m = results[0]["rank0_save"]
    assert re.search(r"rank 0 is in save_pretrained\(\) while rank [123] is in smp.barrier\(\)", m), m
    assert "drop the `if smp.rank() == 0:` around it" in m, m
    for r in (1, 2, 3):
        m = results[r]["rank0_save"]
        assert f"rank {r} is in smp.barrier() while rank 0 is in save_pretrained()" in m, m
    m = results[0]["rank0_state_dict"]
    assert "rank 0 called model.state_dict(), a collective" in m and "ranks [1, 2, 3] did not within" in m, m
    assert "`sd = model.state_dict()` then `if smp.rank() == 0: torch.save(sd, path)`" in m, m
    assert [r["rank0_state_dict"] for r in results[1:]] == ["not called"] * 3
