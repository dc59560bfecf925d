"""Issue 29 item 5: one wrap summary, at INFO on rank 0 only, through logging (logger "shardpar"), even
under warnings.simplefilter("ignore"); a WARNING record when the persistence threshold shards nothing."""

from __future__ import annotations

from tests.multiproc import summary_cases as cases


def test_one_wrap_summary_on_rank_0_says_what_is_sharded(ranks) -> None:
    r0, r1 = ranks.run(2, cases.summary_case, {"sdp_param_persistence_threshold": 10, "sdp_gradient_clipping": 0.5})
    assert r1["records"] == [], "rank 0 alone speaks"
    assert [level for level, _ in r0["records"]] == ["INFO"], r0["records"]
    text = r0["records"][0][1]
    assert text.startswith("shardpar is active: smp.DistributedModel over 2 rank(s)\n"), text
    assert "  layout: sdp 2 x replicas 1 x tp 1; engine " in text, text
    assert f"  units: {r0['units']} (<root>, blocks.0, blocks.1, blocks.2)\n" in text, text
    assert r0["sharded"] > 0 and r0["whole"] > 0, r0
    assert f"{r0['sharded']} tensors (" in text and f"; {r0['whole']} (" in text, text
    assert "sdp_param_persistence_threshold=10 elements" in text, text
    assert r0["param_mib"] in text, text
    assert "clipping: built-in, global L2 max norm 0.5 in optimizer.step() (sdp_gradient_clipping;" in text, text


def test_nothing_sharded_is_a_logged_warning(ranks) -> None:
    """The default threshold (1e6) keeps every parameter of a small model whole: said, not silent."""
    r0, r1 = ranks.run(2, cases.summary_case, {"sdp_gradient_clipping": 0})
    assert r1["records"] == [] and r0["sharded"] == 0, (r0, r1)
    assert [level for level, _ in r0["records"]] == ["INFO", "WARNING"], r0["records"]
    assert "clipping: off (sdp_gradient_clipping=0)" in r0["records"][0][1]
    warning = r0["records"][1][1]
    assert warning.startswith(f"shardpar: nothing is sharded: all {r0['whole']} parameters ("), warning
    assert "sdp_param_persistence_threshold=1,000,000 elements" in warning and "sdp 2 saves no memory" in warning
    assert "set sdp_param_persistence_threshold lower (0 shards every parameter)" in warning, warning
