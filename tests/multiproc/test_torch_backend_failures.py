"""`backend="smddp"` when things go wrong: a failed shm call fails its Work (it returned as if it had
worked, leaving the tensor unreduced), a long PG timeout still reduces, and a member that fails
before any collective leaves nothing in /dev/shm. Plain torch.distributed in spawned processes."""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from shardpar.collectives import shm
from tests.harness import process_context

SHM_OK, SHM_WHY = shm.available()
pytestmark = pytest.mark.skipif(not SHM_OK, reason=SHM_WHY)


def _init(rank: int, port: int, timeout: timedelta = timedelta(seconds=20)) -> None:
    import torch.distributed as dist

    import shardpar.collectives.smddp  # noqa: F401  (registers the backend)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("smddp", rank=rank, world_size=2, timeout=timeout)


def _outcome(fn: Any) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "returned"


def _dead_peer(rank: int, port: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    _init(rank, port)
    t = torch.ones(8)
    dist.all_reduce(t)
    if rank == 1:
        os._exit(3)  # dies between two collectives
    time.sleep(0.5)
    t = torch.ones(8)
    sync = _outcome(lambda: dist.all_reduce(t))
    work = dist.all_reduce(torch.ones(8), async_op=True)
    future = _outcome(lambda: work.get_future().wait())  # what C++ waiters (DDP's reducer) see
    return {"sync": sync, "async_future": future}


def _ddp_dead_peer(rank: int, port: int) -> dict[str, Any]:
    """DDP's reducer waits on the Work's future from C++: the failure must reach it there too."""
    import torch

    _init(rank, port)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    model(torch.randn(4, 64)).sum().backward()
    if rank == 1:
        os._exit(3)
    time.sleep(0.5)
    return {"backward": _outcome(lambda: model(torch.randn(4, 64)).sum().backward())}


def _bad_size(rank: int, port: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    _init(rank, port)
    out = torch.full((3,), -1.0)  # 2 ranks x 2 elements do not fit
    return {"gather": _outcome(lambda: dist.all_gather_into_tensor(out, torch.ones(2)))}


def _long_timeout(rank: int, port: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    _init(rank, port, timeout=timedelta(days=14))  # past the transport's 1e6 s
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    out = torch.zeros(4)
    dist.all_gather_into_tensor(out, torch.full((2,), float(rank + 1)))
    return {"sum": t.tolist(), "gathered": out.tolist()}


def _fails_before_any_collective(rank: int, port: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    _init(rank, port)
    if rank == 1:
        os._exit(1)  # a script error right after init_process_group
    time.sleep(0.5)
    return {"all_reduce": _outcome(lambda: dist.all_reduce(torch.ones(4)))}


def _entry(case: str, rank: int, port: int, out: str) -> None:
    result = globals()[case](rank, port)
    Path(out).write_text(json.dumps(result))
    os._exit(0)  # no destroy_process_group: the peer may be gone


def _run(case: str, tmp: Path) -> list[dict[str, Any] | None]:
    """Both ranks of `case`; a rank still running after 300 s (a bound on a hang that includes the spawn
    and torch's import, which alone took minutes on a loaded machine) is terminated and fails the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = process_context()  # [Note: forkserver ranks] (tests/harness.py)
    outs = [tmp / f"{case}.{r}.json" for r in range(2)]
    procs = [ctx.Process(target=_entry, args=(case, r, port, str(outs[r]))) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 300.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    running = [p for p in procs if p.is_alive()]
    for p in running:
        p.terminate()
        p.join(10)
    if running:
        raise AssertionError(f"{case}: a rank hung")
    return [json.loads(o.read_text()) if o.exists() else None for o in outs]


def _segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("shardpar-pg")}


def test_a_dead_peer_fails_the_survivors_work(tmp_path: Path) -> None:
    survivor, dead = _run("_dead_peer", tmp_path)
    assert dead is None and survivor is not None
    assert survivor["sync"].startswith("ShmPeerError") and "died" in survivor["sync"], survivor
    assert "rank 1 failed first: shm all_reduce: global rank 1 (local index 1" in survivor["sync"], survivor
    assert "returned" not in survivor["async_future"] and "Shm" in survivor["async_future"], survivor


def test_a_dead_peer_fails_ddps_backward(tmp_path: Path) -> None:
    survivor, dead = _run("_ddp_dead_peer", tmp_path)
    assert dead is None and survivor is not None
    assert "ShmPeerError" in survivor["backward"] and "died" in survivor["backward"], survivor


def test_a_bad_argument_fails_on_every_rank(tmp_path: Path) -> None:
    for result in _run("_bad_size", tmp_path):
        assert result is not None and result["gather"] != "returned", result


def test_a_pg_timeout_past_the_transports_limit_still_reduces(tmp_path: Path) -> None:
    for result in _run("_long_timeout", tmp_path):
        assert result == {"sum": [3.0] * 4, "gathered": [1.0, 1.0, 2.0, 2.0]}, result


def test_a_member_failing_before_any_collective_leaves_no_segment(tmp_path: Path) -> None:
    before = _segments()
    # The survivor's first collective finds the peer gone. Attached at that first call, it used to wait
    # for the peer to attach until the launcher stopped it, leaving the segment's name behind. What
    # proves the dead peer was noticed (not waited out) is the error's kind: ShmPeerError from the
    # liveness check, where waiting for the 20 s PG timeout gives ShmTimeoutError -- no time budget
    # (the old 8 s from spawn failed when importing torch alone took that long on a loaded machine).
    first, second = _run("_fails_before_any_collective", tmp_path)
    assert second is None and first is not None and first["all_reduce"].startswith("ShmPeerError"), first
    assert _segments() - before == set()
