"""The causal-LM recipe on 4 CPU ranks: the loss falls, --resume continues exactly, and the model-state
memory it measures from live tensors matches `shardpar estimate` within 10%."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.causal_lm.options import Options, parse_args
from recipes.causal_lm.report import read_metrics
from recipes.causal_lm.train import RunResult, run
from shardpar.config import Config

ROOT = Path(__file__).resolve().parents[2]

TINY = {"sdp_param_persistence_threshold": 1000}


def _opts(out: Path, **changes: object) -> Options:
    base = Options(
        size="tiny", sdp=2, batch=2, seq=32, steps=20, lr=3e-3, warmup=2, out=str(out),
        sample_tokens=8, progress="lines", smp=TINY,
    )  # fmt: skip
    return base.replace(**changes)


def _within(measured: int, estimated: int, tol: float = 0.10) -> bool:
    return abs(measured - estimated) <= tol * measured


@pytest.mark.slow
def test_recipe_trains_then_resume_continues_exactly(ranks, tmp_path: Path) -> None:
    straight = ranks.run(4, run, _opts(tmp_path / "a", checkpoint_every=10), timeout=300)
    first: RunResult = straight[0]
    assert first.steps == list(range(1, 21))
    assert first.losses[-1] < first.losses[0] - 1.0, first.losses
    assert sum(first.losses[-5:]) < sum(first.losses[:5])
    # files rank 0 promised
    records = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 21))
    assert {"loss", "lr", "tokens_per_s", "step_time_s", "rss_mib", "grad_norm"} <= set(records[0])
    assert len(records[0]["rss_mib"]) == 4
    assert (tmp_path / "a" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((Path(first.export or "") / "config.json").read_text())["model_type"] == "gpt_neox"
    assert first.sample is not None and first.sample.startswith("def ")
    # memory: every rank's live model-state bytes against the estimate for the same layout
    for r in straight:
        assert _within(r.model_state_bytes, r.estimated_model_state_bytes), (
            r.model_state_bytes,
            r.estimated_model_state_bytes,
        )

    # resume from the step-10 checkpoint in a fresh run directory: steps 11..20 must repeat exactly
    shutil.copytree(tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints")
    resumed = ranks.run(4, run, _opts(tmp_path / "b", checkpoint_every=10, resume="step10"), timeout=300)[0]
    assert resumed.start_step == 10
    assert resumed.steps == list(range(11, 21))
    diffs = [abs(x - y) for x, y in zip(resumed.losses, first.losses[10:], strict=True)]
    assert max(diffs) <= 1e-6, diffs


@pytest.mark.slow
def test_recipe_bf16_accumulation_checkpointing_and_memory(ranks, tmp_path: Path) -> None:
    """bf16 compute copies, sdp 4, accumulation 2 and activation checkpointing in one short run."""
    opts = _opts(
        tmp_path, sdp=4, precision="bf16", accum=2, steps=4, activation_checkpointing=True,
        export=False, sample_tokens=0,
    )  # fmt: skip
    results = ranks.run(4, run, opts, timeout=300)
    first = results[0]
    assert len(first.losses) == 4 and all(0 < x < 10 for x in first.losses)
    assert first.losses[-1] < first.losses[0]
    for r in results:
        assert _within(r.model_state_bytes, r.estimated_model_state_bytes), (
            r.model_state_bytes,
            r.estimated_model_state_bytes,
        )
    assert first.export is None and first.plot is not None


def test_options_config_file_and_overrides(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('size = "tiny"\nsdp = 2\nsteps = 7\nseq = 64\n[smp]\nsdp_max_live_parameters = 5\n')
    opts = parse_args(["--config", str(cfg), "--steps", "9", "--bf16", "--smp", "sdp_reduce_bucket_size=1e6"])
    assert (opts.sdp, opts.steps, opts.seq, opts.precision) == (2, 9, 64, "bf16")
    knobs = opts.shardpar_config()
    assert knobs["bf16"] and knobs["sdp_max_live_parameters"] == 5 and knobs["sdp_reduce_bucket_size"] == 1_000_000
    assert parse_args(["--resume"]).resume == "newest"
    assert parse_args(["--resume", "step10"]).resume == "step10"
    bad = tmp_path / "bad.json"
    bad.write_text('{"stesp": 3}')
    with pytest.raises(ValueError, match="unknown option"):
        parse_args(["--config", str(bad)])
    with pytest.raises(ValueError, match="--sdp=0 must be >= 1"):
        parse_args(["--sdp", "0"])


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "recipes" / "configs").glob("*.toml")))
def test_shipped_configs_parse_and_their_knobs_validate(config: str) -> None:
    opts = parse_args(["--config", str(ROOT / "recipes" / "configs" / config)])
    knobs = Config.from_dict(opts.shardpar_config(), env={})
    assert knobs.sharded_data_parallel_degree == opts.sdp


def test_png_progress_and_smoothing(tmp_path: Path) -> None:
    import io
    import struct
    import zlib

    from recipes.causal_lm import plot, report

    path = tmp_path / "loss.png"
    plot.loss_curve(path, [1, 2, 3], [3.0, 2.0, float("nan")], [3.0, 2.5, 2.0], size=(64, 48))
    png = path.read_bytes()
    width, height = struct.unpack(">II", png[16:24])
    idat = png.index(b"IDAT")
    (length,) = struct.unpack(">I", png[idat - 4 : idat])
    rows = zlib.decompress(png[idat + 4 : idat + 4 + length])
    assert (width, height) == (64, 48) and len(rows) == 48 * (1 + 64 * 3)
    assert report.smooth([1.0, 2.0, 3.0, 10.0], 3) == [1.0, 2.0, 5.0, 10.0]

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    rec = report.StepRecord(1, 2.5, 1e-3, None, 0.1, 1000.0, 64, [100.0, 110.0])
    bar, log = Tty(), io.StringIO()
    report.Progress(2, stream=bar).update(rec)
    report.Progress(2, stream=log).update(rec)
    assert bar.getvalue().startswith("\rstep 1/2") and "\n" not in bar.getvalue()
    assert log.getvalue().startswith("step 1/2") and log.getvalue().endswith("\n")
    assert "rss/rank 100-110 MiB" in log.getvalue() and "1,000 tok/s" in log.getvalue()


@pytest.mark.slow
def test_recipe_script_under_torchrun_llama_tp2_bf16(tmp_path: Path) -> None:
    """The user's own command: torchrun on recipes/train_causal_lm.py, Llama with tp 2 x sdp 2, bf16."""
    script = Path(__file__).resolve().parents[2] / "recipes" / "train_causal_lm.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(script)]
    cmd += ["--model", "llama", "--tp", "2", "--sdp", "2", "--bf16", "--steps", "6", "--batch", "2", "--seq", "32"]
    cmd += ["--lr", "3e-3", "--warmup", "1", "--sample-tokens", "4", "--progress", "lines", "--out", str(tmp_path)]
    cmd += ["--smp", "sdp_param_persistence_threshold=1000"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = read_metrics(tmp_path / "metrics.jsonl")
    losses = [r["loss"] for r in records]
    assert [r["step"] for r in records] == list(range(1, 7)) and losses[-1] < losses[0], losses
    config = json.loads((tmp_path / "export" / "final" / "config.json").read_text())
    assert config["model_type"] == "llama" and "export:" in proc.stdout and "sample:" in proc.stdout
