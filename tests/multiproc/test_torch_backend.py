"""`init_process_group(backend="smddp")`: an unchanged DDP + FSDP2 script (tests/multiproc/scripts/
ddp_fsdp2.py) under torchrun gives gloo's results, and its hot collectives really went through shm.

gloo's results come from the same script's `run_all` on the suite's gloo pool of that world (one
thread per rank, as the script sets): the same computation on a plain gloo default group, without a
second torchrun (an agent and `world` ranks importing torch) to produce them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardpar.collectives import shm
from tests.multiproc.scripts import ddp_fsdp2

SCRIPT = Path(__file__).parent / "scripts" / "ddp_fsdp2.py"
SHM_OK, SHM_WHY = shm.available()


def _torchrun(world: int, backend: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += [str(SCRIPT), "--backend", backend, "--out", str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{backend} world {world} hung:\n{(exc.stderr or b'')[-4000:]!r}") from None
    assert proc.returncode == 0, f"{backend} world {world} failed:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True))


@pytest.mark.skipif(not SHM_OK, reason=SHM_WHY)
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_and_fsdp2_scripts_run_unchanged_on_smddp(ranks, tmp_path: Path, world: int) -> None:
    gloo = json.loads(json.dumps(ranks.run(world, ddp_fsdp2.run_all, timeout=240)[0]))  # rank 0's, as written
    smddp = _torchrun(world, "smddp", tmp_path / "smddp.json")
    assert smddp["backend"] == "smddp" and gloo["backend"] == "gloo"
    # With 2 ranks a sum has one order, so shm must give gloo's bits; with 4, gloo's ring adds in
    # another order than shm's rank order: equal within fp32 rounding.
    tol = 0.0 if world == 2 else 1e-6
    for framework in ("ddp", "fsdp2"):
        mine, ref = smddp[framework], gloo[framework]
        assert _max_diff(mine["params"], ref["params"]) <= tol, framework
        assert _max_diff([mine["losses"]], [ref["losses"]]) <= tol, framework
    # DDP's gradient buckets and initial broadcast, FSDP2's gathers and reduce-scatters: all shm.
    assert smddp["ddp"]["routes"].get("allreduce shm", 0) >= 4, smddp["ddp"]["routes"]
    assert smddp["ddp"]["routes"].get("broadcast shm", 0) >= 1, smddp["ddp"]["routes"]
    fsdp = smddp["fsdp2"]["routes"]
    assert fsdp.get("all_gather_single shm", 0) > 0 and fsdp.get("reduce_scatter_single shm", 0) > 0, fsdp
    assert not any("fallback" in route for route in fsdp), fsdp
    assert set(smddp["fsdp2"]["groups"]) == {"SmddpProcessGroup"}
    # Functional collectives (full_tensor of each of the 6 sharded parameters) reach our override too:
    # left to torch's trampoline they would hold the GIL into gloo (see torch_backend.py).
    assert smddp["fsdp2"]["full_tensor_routes"] == {"all_gather_single shm": 6}, smddp["fsdp2"]["full_tensor_routes"]
    # What shm does not serve goes to gloo, gives gloo's values, and is counted.
    assert smddp["fallbacks"]["values"] == gloo["fallbacks"]["values"]
    fallbacks = smddp["fallbacks"]["routes"]
    for reason in ("dtype", "op", "layout"):
        assert fallbacks.get(f"allreduce fallback:{reason}") == 1, fallbacks
    if world == 4:  # HSDP: the replicate-axis group AllReduces the reduced shards
        assert fsdp.get("allreduce shm", 0) > 0, fsdp
