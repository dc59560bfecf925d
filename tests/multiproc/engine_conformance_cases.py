"""Conformance cases run on every rank: one suite, every engine (native, smddp).

Each rank builds every rank's input from a per-rank seed, so the expected result is computed locally:
gathers and broadcasts must equal it bit for bit; reductions must match the fp32 sum in rank order
within the rounding of the dtype (gloo adds bf16/fp16 in the dtype itself, one rounding per add).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

import shardpar.api.context as api
from shardpar.collectives import CountingEngine, Engine, Group, NativeEngine, ReduceOp, Span, Work, make_engine
from shardpar.collectives.hierarchical import hierarchical_all_gather
from tests.multiproc.parity import run_parity

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (0, 1, 7, (1 << 16) + 3)


def _groups(world: int) -> list[Group]:
    """Groups of 1..world ranks, some non-contiguous; new_group is called by all ranks in one order."""
    sets = {2: [(0,), (1,), (0, 1)], 4: [(2,), (0, 1), (1, 3), (0, 2, 3), (0, 1, 2, 3)]}[world]
    rank = dist.get_rank()
    out = []
    for ranks in sets:
        pg = dist.group.WORLD if len(ranks) == world else dist.new_group(list(ranks))
        if rank in ranks:
            out.append(Group("test", ranks, pg))
    return out


def _make(name: str, ranks_per_node: int | None = None) -> Engine:
    if name == "native":
        return NativeEngine(timeout_s=60)
    return make_engine(name, timeout_s=60, ranks_per_node=ranks_per_node)


def _input(rank: int, numel: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 17 * numel + salt)
    return torch.randn(numel, generator=gen).to(dtype)


def _close(got: torch.Tensor, want32: torch.Tensor, n: int) -> bool:
    eps = torch.finfo(got.dtype).eps
    tol = 1e-6 if got.dtype == torch.float32 else n * eps
    return bool(torch.allclose(got.float(), want32, rtol=tol, atol=tol * 4))


def _cases(group: Group) -> Iterator[tuple[str, torch.dtype, int]]:
    for dtype in DTYPES:
        for numel in SIZES:
            yield f"{group.ranks} {dtype} numel {numel}", dtype, numel


def check_engine(name: str) -> list[str]:
    """Every op over every group, size and dtype; returns the problems (empty = conformant)."""
    return _check_all(_make(name), name)


def check_smddp_across_nodes(ranks_per_node: int) -> tuple[list[str], dict[tuple[str, str], int]]:
    """The same suite with the world cut into "nodes" of `ranks_per_node`: gathers over groups that
    span nodes take the hierarchical route (mesh between nodes, shm inside); returns problems, routes."""
    engine = _make("smddp", ranks_per_node)
    problems = _check_all(engine, f"smddp rpn {ranks_per_node}")
    return problems, dict(getattr(engine, "routes", {}))


def check_sort_buffer_and_auto() -> dict[str, object]:
    """World 4 as 2 nodes of 2, SMDDP_AG_SORT_BUFFER_SIZE_BYTES = 8192: a cross-node gather of more
    than 8192 * 8 bytes in all falls back to native ("sort"), a smaller one stays hierarchical; both
    give the exact blocks. And ddp_dist_backend="auto" picks the smddp engine on CPU."""
    rank = dist.get_rank()
    group = Group("test", (0, 1, 2, 3), dist.group.WORLD)
    engine = make_engine("smddp", timeout_s=60, ranks_per_node=2, ag_sort_bytes=8192)
    exact = [_all_gather(engine, group, rank, torch.float32, numel) for numel in (100, 4097)]
    routes = dict(getattr(engine, "routes", {}))
    # Strided tensors go to the native engine, are counted there, and come back right (gloo alone
    # reads a column as if it were dense; the smddp engine counted a strided broadcast as shm).
    matrix = torch.arange(12.0).view(3, 4) + 100 * rank
    engine.broadcast(matrix[:, 1], 1, group)
    engine.all_reduce(matrix[:, 2], group)
    others = torch.arange(12.0).view(3, 4)[:, [0, 3]] + 100 * rank
    strided_ok = matrix[:, 1].tolist() == [101.0, 105.0, 109.0] and matrix[:, 2].tolist() == [608.0, 624.0, 640.0]
    strided_ok = strided_ok and torch.equal(matrix[:, [0, 3]], others)  # the other columns untouched
    strided_routes = {k: v for k, v in getattr(engine, "routes", {}).items() if k[0] in ("broadcast", "all_reduce")}
    getattr(engine, "close", lambda: None)()
    auto = make_engine("auto", timeout_s=60)
    auto_name = type(auto).__name__
    getattr(auto, "close", lambda: None)()
    return {"exact": exact, "routes": routes, "auto": auto_name, "strided": (strided_ok, strided_routes)}


def _done_before_wait(work: Work, out: torch.Tensor, want: torch.Tensor) -> tuple[bool, bool]:
    """Poll an async gather without waiting for it (30 s at most): (reported complete, output exact),
    both seen before `wait`; then wait, bounded, so the case cannot hang."""
    deadline = time.monotonic() + 30
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.005)
    seen = (work.is_completed(), torch.equal(out.view(torch.int32), want.view(torch.int32)))
    work.wait(timeout=30)
    return seen


def check_hierarchical_progress_and_knob() -> dict[str, object]:
    """World 4 as 2 nodes of 2, sharding group (0, 1, 2, 3). An async hierarchical gather finishes --
    cross-node step, node step and permute -- without its `wait` (issue 18 item 4): the smddp engine's
    own route, and hierarchical_all_gather over the native engine and over the smddp engine counted
    by a CountingEngine (the model's path). Then sdp_hierarchical_allgather off (item 2): the smddp
    engine routes the same gather natively, with the same blocks."""
    rank = dist.get_rank()
    sharding = Group("sharding", (0, 1, 2, 3), dist.group.WORLD)
    pgs = {ranks: dist.new_group(list(ranks)) for ranks in ((0, 1), (2, 3), (0, 2), (1, 3))}
    node_ranks, cross_ranks = (0, 1) if rank < 2 else (2, 3), (0, 2) if rank % 2 == 0 else (1, 3)
    node = Group("sharding_node", node_ranks, pgs[node_ranks])
    cross = Group("sharding_cross", cross_ranks, pgs[cross_ranks])
    numel = 1001
    mine = _input(rank, numel, torch.float32, 9)
    want = torch.cat([_input(r, numel, torch.float32, 9) for r in sharding.ranks])
    smddp = make_engine("smddp", timeout_s=60, ranks_per_node=2)
    counting = CountingEngine(smddp)
    seen: dict[str, tuple[bool, bool]] = {}
    for name, start in (
        ("smddp", lambda out: smddp.all_gather(out, mine, sharding, async_op=True)),
        (
            "native",
            lambda out: hierarchical_all_gather(
                NativeEngine(timeout_s=60), out, mine, sharding=sharding, node=node, cross=cross, async_op=True
            ),
        ),
        (
            "counting smddp",
            lambda out: hierarchical_all_gather(
                counting, out, mine, sharding=sharding, node=node, cross=cross, async_op=True
            ),
        ),
    ):
        out = torch.full((4 * numel,), 3.0)
        seen[name] = _done_before_wait(start(out), out, want)
    records = [(r.op, r.group, r.bytes) for r in counting.stats.current]
    routes_on = dict(getattr(smddp, "routes", {}))
    getattr(smddp, "close", lambda: None)()
    flat = make_engine("smddp", timeout_s=60, ranks_per_node=2, hierarchical_allgather=False)
    route_off = getattr(flat, "route", lambda *a: "")("all_gather", mine, sharding)
    out = torch.full((4 * numel,), 3.0)
    flat.all_gather(out, mine, sharding)
    exact_off = torch.equal(out, want)
    routes_off = dict(getattr(flat, "routes", {}))
    getattr(flat, "close", lambda: None)()
    return {
        "seen": seen,
        "records": records,
        "routes_on": routes_on,
        "route_off": route_off,
        "exact_off": exact_off,
        "routes_off": routes_off,
    }


def check_engine_agreement() -> dict[str, object]:
    """World 2. The shm transport missing on rank 1 only: every rank builds the native engine, and the
    warning names rank 1. A node of 2 ranks on two hosts (rank 1's host id faked): every rank refuses
    it, naming both ranks. Before, rank 1 went native alone and rank 0 waited in the smddp engine's
    first collective; a node across hosts timed out at its first shm connect."""
    from shardpar.collectives import shm

    rank = dist.get_rank()
    real_available, real_host = shm.available, shm.host_id
    try:
        if rank == 1:
            shm.available = lambda: (False, "test: no transport on this rank")  # type: ignore[assignment]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            picked = [type(make_engine(name, timeout_s=30)).__name__ for name in ("smddp", "auto")]
        shm.available = real_available  # type: ignore[assignment]
        if rank == 1:
            shm.host_id = lambda: "elsewhere/boot"  # type: ignore[assignment]
        try:
            make_engine("smddp", timeout_s=30, ranks_per_node=2)
            spanning = ""
        except ValueError as exc:
            spanning = str(exc)
        try:  # ranks that disagree on ranks_per_node: the same error on both
            make_engine("smddp", timeout_s=30, ranks_per_node=2 if rank == 0 else 1)
            disagree = ""
        except ValueError as exc:
            disagree = str(exc)
        per_host = make_engine("smddp", timeout_s=30, ranks_per_node=1)  # one rank per node: allowed
        per_host_name = type(per_host).__name__
        getattr(per_host, "close", lambda: None)()
    finally:
        shm.available, shm.host_id = real_available, real_host  # type: ignore[assignment]
    return {
        "picked": picked,
        "warnings": [str(w.message) for w in caught],
        "spanning": spanning,
        "disagree": disagree,
        "per_host": per_host_name,
    }


def _check_all(engine: Engine, name: str) -> list[str]:
    rank = dist.get_rank()
    problems: list[str] = []
    for group in _groups(dist.get_world_size()):
        for label, dtype, numel in _cases(group):
            for op, check in CHECKS.items():
                if not check(engine, group, rank, dtype, numel):
                    problems.append(f"{name} {op} {label}")
    problems += _check_many_async(engine, _groups(dist.get_world_size())[-1], rank)
    getattr(engine, "close", lambda: None)()
    return problems


def _all_gather(engine: Engine, group: Group, rank: int, dtype: torch.dtype, numel: int) -> bool:
    out = torch.full((numel * group.size,), 3.0, dtype=dtype)
    engine.all_gather(out, _input(rank, numel, dtype, 1), group)
    want = torch.cat([_input(r, numel, dtype, 1) for r in group.ranks])
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    return torch.equal(out.view(bits), want.view(bits))


def _reduce_scatter(engine: Engine, group: Group, rank: int, dtype: torch.dtype, numel: int) -> bool:
    ok = True
    for op in (ReduceOp.SUM, ReduceOp.AVG):
        out = torch.empty(numel, dtype=dtype)
        engine.reduce_scatter(out, _input(rank, numel * group.size, dtype, 2), group, op=op)
        total = sum(
            (_input(r, numel * group.size, dtype, 2).float() for r in group.ranks), torch.zeros(numel * group.size)
        )
        want = total.view(group.size, numel)[group.rank_of(rank)] if numel else torch.empty(0)
        ok &= _close(out, want / (group.size if op is ReduceOp.AVG else 1), group.size)
    return ok


def _reduce_scatter_spans(engine: Engine, group: Group, rank: int, dtype: torch.dtype, numel: int) -> bool:
    """The input cut into a slice, a run of zeros and the rest in spans of `numel` (not at row bounds):
    the same bits as reduce_scatter of the tensor the spans stand for, on the same engine."""
    x = _input(rank, numel * group.size, dtype, 4)
    a, k = x.numel() // 3, min(5, x.numel() - x.numel() // 3)
    spans: list[Span] = [x[:a], k, *x[a + k :].split(max(1, numel))]
    equal = x.clone()
    equal[a : a + k] = 0
    got, want = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
    engine.reduce_scatter_spans(got, spans, group, op=ReduceOp.AVG, async_op=True).wait()
    engine.reduce_scatter(want, equal, group, op=ReduceOp.AVG)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    return torch.equal(got.view(bits), want.view(bits))


def _all_reduce(engine: Engine, group: Group, rank: int, dtype: torch.dtype, numel: int) -> bool:
    t = _input(rank, numel, dtype, 3)
    engine.all_reduce(t, group, async_op=True).wait()
    want = sum((_input(r, numel, dtype, 3).float() for r in group.ranks), torch.zeros(numel))
    return _close(t, want, group.size)


def _broadcast(engine: Engine, group: Group, rank: int, dtype: torch.dtype, numel: int) -> bool:
    src = group.ranks[-1]
    t = _input(rank, numel, dtype, 4)
    engine.broadcast(t, src, group)
    return torch.equal(t.float(), _input(src, numel, dtype, 4).float())


CHECKS: dict[str, Callable[[Engine, Group, int, torch.dtype, int], bool]] = {
    "reduce_scatter_spans": _reduce_scatter_spans,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_reduce": _all_reduce,
    "broadcast": _broadcast,
}


def _check_many_async(engine: Engine, group: Group, rank: int) -> list[str]:
    """24 outstanding calls of mixed kinds, waited for in reverse order."""
    sizes = [(i * 997) % 5000 + 1 for i in range(8)]
    gathers = [torch.empty(n * group.size) for n in sizes]
    reduces = [_input(rank, n, torch.float32, 5) for n in sizes]
    scatters = [torch.empty(n) for n in sizes]
    works = []
    for i, n in enumerate(sizes):
        works.append(engine.all_gather(gathers[i], _input(rank, n, torch.float32, 6), group, async_op=True))
        works.append(engine.all_reduce(reduces[i], group, async_op=True))
        works.append(
            engine.reduce_scatter(scatters[i], _input(rank, n * group.size, torch.float32, 7), group, async_op=True)
        )
    for w in reversed(works):
        w.wait(timeout=60)
    bad = []
    for i, n in enumerate(sizes):
        if not torch.equal(gathers[i], torch.cat([_input(r, n, torch.float32, 6) for r in group.ranks])):
            bad.append(f"async all_gather #{i}")
        if not _close(
            reduces[i], sum((_input(r, n, torch.float32, 5) for r in group.ranks), torch.zeros(n)), group.size
        ):
            bad.append(f"async all_reduce #{i}")
        full = sum((_input(r, n * group.size, torch.float32, 7) for r in group.ranks), torch.zeros(n * group.size))
        if not _close(scatters[i], full.view(group.size, n)[group.rank_of(rank)], group.size):
            bad.append(f"async reduce_scatter #{i}")
    comms = getattr(engine, "_comms", {})  # smddp: waits on its worker thread sleep, on the caller spin
    if group.ranks in comms:  # a group on one node (else its calls are native)
        if not comms[group.ranks].patient:
            bad.append("the worker's collectives were not patient")
        engine.all_reduce(torch.zeros(1), group)  # nothing queued: runs on the caller
        if comms[group.ranks].patient:
            bad.append("a collective on the caller's thread was patient")
    return bad


def parity_with_engine_stats(model: str, knobs: dict[str, Any]) -> dict[str, Any]:
    """run_parity, plus the inner engine's name, routes and fallbacks (captured before shutdown)."""
    made: list[Any] = []
    original = api.make_engine

    def spy(*args: Any, **kwargs: Any) -> Engine:
        engine = original(*args, **kwargs)
        made.append(engine)
        return engine

    counting: list[Any] = []
    original_counting = api.CountingEngine

    def counting_spy(inner: Engine) -> Any:
        counted = original_counting(inner)
        counting.append(counted)
        return counted

    api.make_engine = spy
    api.CountingEngine = counting_spy  # type: ignore[assignment,misc]
    try:
        result: dict[str, Any] = dict(run_parity(model, knobs))
    finally:
        api.make_engine = original
        api.CountingEngine = original_counting  # type: ignore[misc]
    stats = counting[0].stats
    records = [r for step in stats.history for r in step] + stats.current
    result["recorded_engines"] = sorted({(r.op, r.engine) for r in records})
    engine = made[0]
    result["engine"] = engine.name
    result["fallbacks"] = dict(getattr(engine, "fallbacks", {}))
    result["routes"] = dict(getattr(engine, "routes", {}))
    return result
