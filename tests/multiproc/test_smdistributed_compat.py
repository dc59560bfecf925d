"""Issue 30 item 3 on 2 ranks: the unedited SMP v1 script (tests/multiproc/scripts/smp_v1_unedited.py),
launched by torchrun with shardpar-smdistributed installed and SageMaker's variables set, trains with
sharded data parallelism over both ranks (sdp 2) and transformers' own SMP helpers."""

from __future__ import annotations

import json
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

from tests import smdistributed_compat as compat


def test_an_unedited_v1_script_runs_on_two_ranks_under_torchrun(compat_site: Path, tmp_path: Path) -> None:
    run = compat.runner(compat_site, tmp_path)  # the session's install (conftest.py)
    options = {"partitions": 1, "ddp": True, "sharded_data_parallel_degree": 2}
    env = compat.clean_env(**{**compat.SAGEMAKER_ENV, "SM_HP_MP_PARAMETERS": json.dumps(options)})
    out = tmp_path / "result"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(run)]
    proc = subprocess.run([*cmd, str(compat.V1_SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    for r in results:
        assert r["is_sagemaker_mp_enabled"] and r["smp_is_shardpar"] and r["sdp"] == 2, r
        assert all(a > b for a, b in pairwise(r["losses"])), r["losses"]
        assert r["gathered_rows_are_the_batch"]  # smp_gather put rank 0's rows, then rank 1's
        # Trainer.save_model's SMP branch: rank 0 alone writes the state dict every rank gathered
        assert "model.safetensors" in r["saved"], r["saved"]
    # Both ranks read different rows but hold one model: the sharded steps reduced their gradients.
    assert results[0]["losses"] != results[1]["losses"]
    assert results[0]["checksum"] == results[1]["checksum"]
