"""Models built on the meta device (accelerate's init_empty_weights): HF init, re-tied weights, and
meta buffers refused rather than zero-filled."""

from __future__ import annotations

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
