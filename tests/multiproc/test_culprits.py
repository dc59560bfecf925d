"""Every survivor names the rank that failed first ([Note: first failure], collectives/failures.py), on
both engines.

Four spawned ranks on gloo. Rank 2 is killed (SIGKILL: it posts nothing) or hangs outside any
collective. Rank 3 waits for it in the group {2, 3}, fails, and exits -- as a launched rank would --
while ranks 0 and 1 wait for rank 3 in {0, 1, 3}: they see only rank 3 go (a "secondary casualty",
which they named before) or stop arriving, and must still name rank 2.

No clock is read to judge the outcome: a killed rank must be named without anyone timing out (the
collectives' timeout is then a minute, so waiting for it shows as a timeout error), a hung one after
the collectives' 3 s timeout; `_run` bounds the whole run (120 s) and fails on a rank that never reports.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from shardpar.collectives import shm
from tests.harness import process_context

TIMEOUT_S = 3.0  # "hung": the victim is only found by timing out
KILLED_TIMEOUT_S = 60.0  # "killed": far longer than noticing a death takes, even on a loaded machine
WORLD = 4
VICTIM = 2


def _engine(name: str, timeout_s: float) -> Any:
    from shardpar.collectives import NativeEngine, make_engine

    if name == "native":
        return NativeEngine(timeout_s=timeout_s)
    return make_engine("smddp", timeout_s=timeout_s, ranks_per_node=WORLD)


def _case(rank: int, port: int, engine_name: str, how: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from shardpar.collectives import Group

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    engine = _engine(engine_name, KILLED_TIMEOUT_S if how == "killed" else TIMEOUT_S)
    groups = {ranks: Group("test", ranks, dist.new_group(list(ranks))) for ranks in ((2, 3), (0, 1, 3))}
    world = Group("world", tuple(range(WORLD)), dist.group.WORLD)
    for ranks, group in groups.items():  # connect every communicator while all ranks are alive
        if rank in ranks:
            engine.all_reduce(torch.ones(8), group)
    engine.all_reduce(torch.ones(8), world)
    if rank == VICTIM:
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(TIMEOUT_S + 30)  # hung, alive, in no collective; the test stops it
        os._exit(0)
    mine = (2, 3) if rank == 3 else (0, 1, 3)
    try:
        engine.all_reduce(torch.ones(1000), groups[mine], async_op=rank != 3).wait()
        result: dict[str, Any] = {"error": None}
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "culprit": getattr(exc, "culprit", None)}
        result["cause"] = repr(exc.__cause__)
        result["timed_out"] = isinstance(exc, TimeoutError)
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    if rank != 3:  # rank 0 hosts the store: stay until the other readers are done with it
        deadline = time.monotonic() + 30
        while not all(Path(out_dir, f"{r}.json").exists() for r in (0, 1, 3)) and time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(0)  # no destroy_process_group: peers are gone


def _run(engine_name: str, how: str, tmp: Path) -> dict[int, dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = process_context()  # [Note: forkserver ranks] (tests/harness.py)
    procs = [ctx.Process(target=_case, args=(r, port, engine_name, how, str(tmp))) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    for r, p in enumerate(procs):
        if r != VICTIM:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)
    results = {
        r: json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(WORLD) if Path(tmp, f"{r}.json").exists()
    }
    assert sorted(results) == [0, 1, 3], f"survivors that reported: {sorted(results)} (a rank hung or crashed)"
    return results


ENGINES = ["native", pytest.param("smddp", marks=pytest.mark.skipif(not shm.available()[0], reason="no shm"))]


@pytest.mark.parametrize("how", ["killed", "hung"])
@pytest.mark.parametrize("engine_name", ENGINES)
def test_every_survivor_names_the_rank_that_failed_first(engine_name: str, how: str, tmp_path: Path) -> None:
    results = _run(engine_name, how, tmp_path)
    for rank, result in results.items():
        assert result["error"] is not None, (rank, result)
        assert f"rank {VICTIM} failed first" in result["error"] and result["culprit"] == VICTIM, (rank, result)
        assert result["cause"] != "None", (rank, result)  # the transport's / gloo's own error is kept
    if how == "killed":  # nobody waits for a timeout to learn of a death
        assert not any(r["timed_out"] for r in results.values()), results
