"""The README's main job, end to end (short): `shardpar demo` starts 4 ranks itself, the loss falls, and
it says where the plot, metrics, checkpoint and Hugging Face export are."""

from __future__ import annotations

import json
from pathlib import Path

from shardpar.cli import main


def _path_after(out: str, label: str) -> Path:
    line = next(ln for ln in out.splitlines() if ln.strip().startswith(label))
    return Path(line.split(label, 1)[1].split()[0])


def test_demo_trains_and_says_where_everything_is(capfd, tmp_path: Path) -> None:
    assert main(["demo", "--steps", "8", "--seq", "32", "--out", str(tmp_path / "demo")]) == 0
    out = capfd.readouterr().out  # rank 0 prints from its own process
    assert "sharding groups (each holds one copy of the model, split 2 ways): [(0, 1), (2, 3)]" in out
    assert "(falling)" in out and "tok/s" in out and "tokens/s" in out
    assert _path_after(out, "loss curve:").read_bytes()[:4] == b"\x89PNG"
    assert len(_path_after(out, "metrics:").read_text().splitlines()) == 8
    assert json.loads((_path_after(out, "hf export:") / "config.json").read_text())["model_type"] == "gpt_neox"
    assert _path_after(out, "checkpoint:").is_dir()


def test_env_previews_the_reference_layout(capsys) -> None:
    assert main(["env", "--world", "32", "--tp", "4", "--sdp", "4", "--ranks-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "sharding        8 x 4: (0, 4, 8, 12), (16, 20, 24, 28)" in out
    assert "smddp shared-memory extension:" in out and "gloo True" in out


def test_bad_flags_give_a_clear_error(capsys) -> None:
    assert main(["env", "--world", "8", "--sdp", "3"]) == 2
    assert "sharded_data_parallel_degree=3 must divide the rdp degree 8" in capsys.readouterr().err
