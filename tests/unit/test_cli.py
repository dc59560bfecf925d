"""The command line refuses what smp.init would refuse, and options that contradict each other, with
argparse's exit status 2 and a message naming the value, the rule and the fix -- before any work."""

from __future__ import annotations

import pytest

from shardpar.cli import main


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """stderr of a refused command; argparse errors exit, the rest return the status."""
    try:
        status = main(argv)
    except SystemExit as exit:
        status = exit.code
    out, err = capsys.readouterr()
    assert status == 2, f"{argv} gave {status}:\n{out}{err}"
    return err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sdp", "3"], "sharded_data_parallel_degree=3 must divide the reduced data-parallel degree 8"),
        (["--sdp", "16"], "try one of 1, 2, 4, 8"),
        (["--tp", "3", "--sdp", "1"], "tensor_parallel_degree=3 must divide the world size 8; try one of 1, 2, 4, 8"),
        (["--nodes", "0"], "argument --nodes: 0 must be >= 1"),
        (["--params", "13e9", "--layers", "0"], "argument --layers: 0 must be >= 1"),
        (["--params", "13e9", "--hidden", "5120", "--layers", "2"], "describes 1.14e+09 parameters"),
        (["--params", "13e9", "--hidden", "64"], "deeper than the model is wide; give a wider hidden"),
        (["--tp", "4", "--global-batch", "8"], "--tp 4 conflicts with --global-batch 8, which gives tp 1"),
        (["--hf-config", "/nonexistent/config.json"], "'/nonexistent/config.json' does not exist"),
        (["--gpus", "4"], "--gpus 4 needs --device"),
        (["--device", "cpu", "--nodes", "2"], "with --device cpu give the devices in all as --gpus"),
        (["--hidden", "128"], "--model gpt-neox-20b brings its own dimensions"),
    ],
)
def test_estimate_refuses_impossible_or_conflicting_options(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(["estimate", *argv], capsys)
    assert message in err and "shardpar estimate: error:" in err, err


def test_estimate_accepts_a_tp_that_agrees_with_the_global_batch(capsys: pytest.CaptureFixture[str]) -> None:
    # 16 devices, global batch 8 of batch 1: 8 data-parallel ranks, tp 2
    assert main(["estimate", "--params", "1e9", "--nodes", "2", "--global-batch", "8", "--tp", "2", "--sdp", "4"]) == 0
    assert "world 16, tp 2" in capsys.readouterr().out


def test_demo_refuses_fewer_than_two_steps_before_training(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One step cannot show the loss falling (the run then exited 1 after training)."""
    import shardpar.cli.launcher

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("the demo started training")

    monkeypatch.setattr(shardpar.cli.launcher, "launch_local", no_training)
    assert "argument --steps: 1 must be >= 2: the demo checks that the loss falls" in _refused(
        ["demo", "--steps", "1"], capsys
    )
    for flag in ("--nprocs", "--sdp", "--batch", "--seq"):  # 0 started 4 ranks or failed inside them
        assert f"argument {flag}: 0 must be >= 1" in _refused(["demo", flag, "0"], capsys)
