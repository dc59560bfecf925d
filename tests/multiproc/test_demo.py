"""The README's main job, end to end (short): 4 spawned ranks train and the loss falls."""

from __future__ import annotations

from shardpar.cli import main


def test_demo_trains_and_loss_falls(capfd) -> None:
    assert main(["demo", "--steps", "8", "--seq", "32"]) == 0
    out = capfd.readouterr().out  # rank 0 prints from its own process
    assert "sharding groups (each holds one copy of the model, split 2 ways): [(0, 1), (2, 3)]" in out
    assert "(falling)" in out and "tokens/s" in out


def test_env_previews_the_reference_layout(capsys) -> None:
    assert main(["env", "--world", "32", "--tp", "4", "--sdp", "4", "--ranks-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "sharding        8 x 4: (0, 4, 8, 12), (16, 20, 24, 28)" in out


def test_bad_flags_give_a_clear_error(capsys) -> None:
    assert main(["env", "--world", "8", "--sdp", "3"]) == 2
    assert "sharded_data_parallel_degree=3 must divide the rdp degree 8" in capsys.readouterr().err
