"""Models built on the meta device (accelerate's init_empty_weights): HF init, re-tied weights, and
meta buffers refused rather than zero-filled."""

from __future__ import annotations

import pytest

from tests.multiproc import materialize_cases as cases


def test_hf_model_on_meta_gets_hf_init(ranks) -> None:
    for r in ranks.run(2, cases.hf_init_case):
        std = r["initializer_range"]
        assert abs(r["embed_std"] - std) <= 0.25 * std, r["embed_std"]  # torch's Embedding default is 1.0
        for name, got in r["weight_stds"].items():
            assert abs(got - std) <= 0.25 * std, (name, got)  # nn.Linear's kaiming default is ~0.1 here
        assert r["norms_one"] and r["biases_zero"] and r["same_on_ranks"]
        assert abs(r["loss"] - r["log_vocab"]) < 0.1, "a 0.02-init LM starts near uniform"


def test_gpt2_on_meta_is_retied_and_trains_like_a_normal_one(ranks) -> None:
    for r in ranks.run(2, cases.gpt2_tied_case):
        assert r["untied_before"], "accelerate no longer unties: this test no longer covers the re-tie"
        assert r["tied_after"]
        assert abs(r["c_proj_std"] - r["c_proj_expected"]) <= 0.25 * r["c_proj_expected"], r
        assert abs(r["wte_std"] - r["initializer_range"]) <= 0.25 * r["initializer_range"], r
        assert r["param"] <= 1e-5, r


def test_meta_buffers_are_an_error_naming_the_buffer_and_the_fix(ranks) -> None:
    for r in ranks.run(2, cases.meta_buffer_case):
        assert "gpt_neox.rotary_emb.inv_freq" in r["error"], r["error"]
        assert "smp.delay_param_initialization()" in r["error"], r["error"]
        assert "include_buffers=False" in r["error"], r["error"]
        assert r["alive"] and r["default_inv_freq_ok"]


@pytest.mark.parametrize("how", ["deferred", "meta"])
def test_wrapping_holds_at_most_the_shards_plus_one_full_parameter(ranks, how: str) -> None:
    """The issue: under smp.delay_param_initialization() or the meta device "no rank ever holds more
    than its shards plus one full parameter" -- measured as the peak bytes of the storages created
    while smp.DistributedModel runs. The only allowance: buffers materialised whole (replicated)."""
    for rank, r in enumerate(ranks.run(2, cases.construction_peak_case, how)):
        bound = r["shards"] + r["largest_param"] + r["made_buffers"]
        assert r["peak"] <= bound, f"rank {rank}: peak {r['peak']} B > {bound} B ({r})"
        assert bound < r["full_model"], "the model is too small for the bound to tell sharding from a full copy"
        assert r["peak"] > r["shards"], f"rank {rank}: the tracker saw no full parameter ({r})"
        assert r["live_after"] == r["shards"] + r["made_buffers"], f"rank {rank}: a full parameter outlived wrapping"


def test_delayed_parameter_initialization_refuses_a_model_built_normally(ranks) -> None:
    for r in ranks.run(2, cases.delayed_knob_case):
        error = r["real"]
        assert "delayed_parameter_initialization=True" in error, error
        assert "gpt_neox.embed_in.weight" in error and "smp.delay_param_initialization()" in error, error
        assert "init_empty_weights()" in error and "delayed_parameter_initialization=False" in error, error
        assert r["alive"]
        assert (r["deferred"], r["meta"], r["tp"], r["knob_off"]) == ("", "", "", ""), r
