"""`shardpar convert` (issue 32 item 5), offline in this process: a DCP checkpoint of a model and its
AdamW state (what torch's get_state_dict gives, here for one process) round-trips through shardpar's
format and back bit for bit; the Hugging Face leg keeps the weights; bad input is refused by name.
test_dcp.py loads converted checkpoints into shardpar and FSDP2 jobs."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from shardpar.checkpoint import convert, dcp_files
from shardpar.cli.main import main
from tests import models
from tests.multiproc.fsdp2_cases import _adamw, _same, _step


def _trained() -> dict[str, Any]:
    model = models.tiny_neox(0)
    opt = _adamw(model)
    for seed in (1, 2):
        _step(model, opt, seed)
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def test_dcp_shardpar_dcp_and_hf_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    want = _trained()
    dcp_files.write(tmp_path / "dcp", want)
    assert _same(dcp_files.read(tmp_path / "dcp"), want) == []  # the offline reader alone
    # DCP records no optimizer class: converting to shardpar without it is refused, naming the option
    assert main(["convert", str(tmp_path / "dcp"), str(tmp_path / "ours"), "--to", "shardpar"]) == 2
    assert "--optimizer-class" in capsys.readouterr().err
    assert not (tmp_path / "ours" / "converted_partial").exists()
    argv = ["convert", str(tmp_path / "dcp"), str(tmp_path / "ours"), "--to", "shardpar", "--optimizer-class", "AdamW"]
    assert main(argv) == 0
    ours = convert.read(tmp_path / "ours")
    assert ours.optimizer_class == "AdamW"
    assert _same({"model": ours.model, "optim": ours.optim}, want) == []
    assert main(["convert", str(tmp_path / "ours"), str(tmp_path / "back"), "--to", "dcp"]) == 0
    assert _same(dcp_files.read(tmp_path / "back"), want) == []
    assert main(["convert", str(tmp_path / "back"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert _same(convert.read(tmp_path / "hf").model, want["model"]) == []
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ours2"), "--to", "shardpar"]) == 0
    assert _same(convert.read(tmp_path / "ours2").model, want["model"]) == []
    # never over an existing directory
    assert main(["convert", str(tmp_path / "ours"), str(tmp_path / "back"), "--to", "dcp"]) == 2
    assert "not empty" in capsys.readouterr().err


class _Boom:
    def __reduce__(self) -> Any:
        return (print, ("ran",))


def test_dcp_metadata_that_would_run_code_is_refused(tmp_path: Path) -> None:
    dcp_files.write(tmp_path / "dcp", {"model": {"w": torch.ones(3)}})
    md = dcp_files.read_metadata(tmp_path / "dcp")
    md.planner_data = {"w": _Boom()}  # what a crafted .metadata could carry
    (tmp_path / "dcp" / dcp_files.METADATA).write_bytes(pickle.dumps(md))
    with pytest.raises(pickle.UnpicklingError, match=r"builtins\.print"):
        dcp_files.read(tmp_path / "dcp")


def test_unknown_source_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a checkpoint convert knows"):
        convert.detect(tmp_path)
