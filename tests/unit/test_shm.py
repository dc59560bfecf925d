"""The shared-memory transport (shardpar/collectives/shm.py over shardpar/csrc/shm_transport.c).

Collectives run on 2 and 4 spawned local processes, reused across cases (spawning costs seconds on 2
cores). Every case has a deadline: a rank that hangs fails the test and the processes are killed.

Exactness: the transport adds in fp32 in rank order and rounds once, so every reduction is compared
bit for bit with `(x_0 + x_1 + ... in fp32, divided by n for avg).to(dtype)` computed sequentially in
torch; fp32 results therefore match exactly too (stronger than an rtol of 1e-6).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pwd
import signal
import stat
import struct
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import pytest
import torch

from shardpar.collectives import shm
from tests.harness import process_context

pytestmark = pytest.mark.skipif(not shm.available()[0], reason=f"shm transport unavailable: {shm.available()[1]}")

DEV_SHM = Path("/dev/shm")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MiB = 1 << 20


# ---- a small pool of spawned ranks ----------------------------------------------------------------


def _serve(index: int, size: int, conn: Connection) -> None:
    torch.set_num_threads(1)  # up to 4 ranks share 2 cores
    conn.send(("ok", "ready"))  # torch is imported: cases' timeouts no longer include the start-up
    while True:
        msg = conn.recv()
        if msg is None:
            return
        fn, args = msg
        try:
            conn.send(("ok", fn(index, size, *args)))
        except BaseException:
            conn.send(("err", traceback.format_exc()))


class Ranks:
    """`size` spawned processes; `run(fn, *args)` calls `fn(index, size, *args)` on each of them."""

    def __init__(self, size: int) -> None:
        ctx = process_context()  # [Note: forkserver ranks] (tests/harness.py)
        self.size = size
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for index in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(index, size, child), daemon=True, name=f"shm-rank{index}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        # Spawning imports torch, which takes a minute or more on a loaded 2-core machine: a bound on
        # a hang, kept out of the cases' own timeouts.
        self.collect(timeout=600)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def start(self, fn: Callable[..., Any], *args: Any) -> None:
        for conn in self.conns:
            conn.send((fn, args))

    def collect(self, timeout: float, indices: list[int] | None = None) -> list[Any]:
        """Results of `indices` (default all); raises on an error, a death, or after `timeout` seconds."""
        pending = list(range(self.size)) if indices is None else list(indices)
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while pending:
            ready = wait([self.conns[i] for i in pending], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.close()
                raise AssertionError(f"ranks {pending} did not finish within {timeout} s (killed)")
            for i in [i for i in pending if self.conns[i] in ready]:
                pending.remove(i)
                try:
                    kind, value = self.conns[i].recv()
                except EOFError:
                    self.close()
                    raise AssertionError(f"rank {i} died (exit code {self.procs[i].exitcode})") from None
                if kind != "ok":
                    self.close()
                    raise AssertionError(f"rank {i} raised:\n{value}")
                results[i] = value
        return [results[i] for i in sorted(results)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> list[Any]:
        self.start(fn, *args)
        return self.collect(timeout)

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    conn.send(None)
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


_POOLS: dict[int, Ranks] = {}


@pytest.fixture(scope="module")
def ranks() -> Iterator[Callable[[int], Ranks]]:
    def get(size: int) -> Ranks:
        if size not in _POOLS or not _POOLS[size].alive:
            _POOLS[size] = Ranks(size)
        return _POOLS[size]

    yield get
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def _key() -> str:
    return f"t{os.getpid()}-{uuid.uuid4().hex[:10]}"


def _leftovers(key: str) -> list[str]:
    return sorted(p.name for p in DEV_SHM.iterdir() if key in p.name)


# ---- references -----------------------------------------------------------------------------------


def _inputs(size: int, numel: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Rank r's input, identical in every process (so each rank can compute the reference)."""
    out = []
    for r in range(size):
        g = torch.Generator().manual_seed(seed * 100 + r)
        if dtype.is_floating_point:
            out.append(torch.randn(numel, generator=g).to(dtype))
        else:
            out.append(torch.randint(-(2**62), 2**62, (numel,), generator=g, dtype=dtype))
    return out


def _reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    acc = inputs[0].to(torch.float32, copy=True)
    for x in inputs[1:]:
        acc += x.float()
    if op == "avg":  # tensor / tensor: an IEEE division, never a multiply by 1/n
        acc = acc / torch.full_like(acc, len(inputs))
    return acc.to(inputs[0].dtype)


def _as_spans(x: torch.Tensor, seed: int) -> tuple[list[torch.Tensor | int], torch.Tensor]:
    """x cut at random points into spans (some empty), every third one replaced by a zero count: the
    spans, and the tensor they stand for (x with those ranges zeroed)."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(0, x.numel() + 1, (7,), generator=g).tolist())
    bounds = [0, *cuts, x.numel()]
    spans: list[torch.Tensor | int] = []
    equal = x.clone()
    for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        if i % 3 == 1:
            spans.append(hi - lo)
            equal[lo:hi] = 0
        else:
            spans.append(x[lo:hi])
    return spans, equal


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when equal bit for bit (any NaN matches any NaN), else a short description."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"
    differ = _bits(got) != _bits(want)
    if got.is_floating_point():
        differ &= ~(got.isnan() & want.isnan())
    if not bool(differ.any()):
        return None
    first = int(differ.nonzero()[0])
    return f"{int(differ.sum())} of {got.numel()} differ, first at {first}: {got[first].item()} != {want[first].item()}"


# ---- single process: the reduction kernels --------------------------------------------------------


def _isas() -> list[str]:
    order = ["scalar", "avx2", "avx512"]
    return order[: order.index(shm.best_isa()) + 1]


def _special_values(dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    vals = [0.0, -0.0, 1.0, -1.0, info.max, -info.max, info.tiny, info.tiny / 4, -info.tiny / 8, info.eps]
    vals += [float("inf"), float("-inf"), float("nan"), 1.0 + info.eps / 2, 3.0e-39, 1e-45]
    return torch.tensor(vals, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_reduce_kernels_round_like_torch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    specials = _special_values(dtype)
    for nsrc in (1, 2, 3, 4):
        for numel in (0, 1, 15, 16, 17, 63, 64, 65, 1001, 4099):
            srcs = [(torch.randn(numel, generator=g) * 10 ** (4 * r - 6)).to(dtype) for r in range(nsrc)]
            for s in srcs:  # sprinkle specials (inf/nan/denormals/ties) at random places
                where = torch.randint(0, max(numel, 1), (min(numel, 8),), generator=g)
                s[where] = specials[torch.randint(0, len(specials), (len(where),), generator=g)]
            for op in ("sum", "avg"):
                want = _reference(srcs, op)
                for isa in _isas():
                    got = torch.empty(numel, dtype=dtype)
                    shm.reduce_kernel(got, srcs, op, isa=isa)
                    assert _mismatch(got, want) is None, f"{isa} {op} nsrc={nsrc} numel={numel}: {_mismatch(got, want)}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reduce_kernels_every_16bit_pattern(dtype: torch.dtype) -> None:
    """All 65536 bit patterns, plus random pairs: exercises every rounding case of fp32 -> 16 bit."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    g = torch.Generator().manual_seed(3)
    pair = [torch.randint(-(2**15), 2**15, (1 << 18,), generator=g, dtype=torch.int32).to(torch.int16).view(dtype)
            for _ in range(2)]  # fmt: skip
    for srcs in ([every], [every, every.flip(0)], pair):
        want = _reference(srcs, "sum")
        for isa in _isas():
            got = torch.empty_like(srcs[0])
            shm.reduce_kernel(got, srcs, "sum", isa=isa)
            assert _mismatch(got, want) is None, f"{isa}: {_mismatch(got, want)}"


def test_stream_copy_is_exact_at_every_alignment_and_rejects_bad_arguments() -> None:
    """The benchmarks' copy floor (shm.stream_copy) is the transport's own copy: byte-exact whatever the
    alignment of either end and the length (vector body, unaligned head and tail), streaming or not."""
    g = torch.Generator().manual_seed(5)
    src = torch.randint(0, 256, (70_000,), dtype=torch.uint8, generator=g)
    for non_temporal in (True, False):
        for src_off, dst_off, length in [(0, 0, 65_536), (3, 61, 65_536), (1, 0, 4_099), (0, 7, 257), (5, 5, 0)]:
            dst = torch.zeros(70_000, dtype=torch.uint8)
            shm.stream_copy(dst[dst_off : dst_off + length], src[src_off : src_off + length], non_temporal=non_temporal)
            assert torch.equal(dst[dst_off : dst_off + length], src[src_off : src_off + length])
            assert not dst[:dst_off].any() and not dst[dst_off + length :].any(), "wrote outside the range"
    with pytest.raises(ValueError, match="same number of bytes"):
        shm.stream_copy(torch.empty(4), torch.empty(5))
    with pytest.raises(ValueError, match="must not overlap"):
        shm.stream_copy(src[:100], src[50:150])


def test_single_rank_communicator_and_argument_errors() -> None:
    key = _key()
    with shm.ShmComm(key, 0, 0, 1, timeout_s=5) as comm:
        x = torch.randn(1001)
        out = torch.empty(1001)
        comm.all_gather(out, x)
        assert torch.equal(out, x)
        comm.all_reduce(out, "avg")
        assert torch.equal(out, x)
        comm.barrier()
        with pytest.raises(ValueError, match="must be 1 x"):
            comm.all_gather(torch.empty(5), x)
        comm.reduce_scatter_spans(out, [x[:10], 0, 5, x[15:]], "sum")
        assert torch.equal(out, torch.cat([x[:10], torch.zeros(5), x[15:]]))
        with pytest.raises(ValueError, match="hold 1000 elements but must hold 1 x"):
            comm.reduce_scatter_spans(out, [x[:999], 1])
        with pytest.raises(ValueError, match=r"spans\[1\] is torch.bfloat16"):
            comm.reduce_scatter_spans(out, [x[:1000], x[:1].bfloat16()])
        with pytest.raises(ValueError, match=r"spans\[0\] overlaps out"):
            comm.reduce_scatter_spans(out, [out])
        with pytest.raises(ValueError, match="asks for -1 zeros"):
            comm.reduce_scatter_spans(out, [x, -1, 1])
        with pytest.raises(ValueError, match="contiguous CPU tensor"):
            comm.all_reduce(torch.randn(4, 4).t())
        with pytest.raises(TypeError, match="not reducible"):
            comm.all_reduce(torch.zeros(3, dtype=torch.int64))
        with pytest.raises(ValueError, match="op 'max'"):
            comm.all_reduce(x, "max")
        with pytest.raises(ValueError, match="root 3 is not a local index"):
            comm.broadcast(x, 3)
    with pytest.raises(ValueError, match="is closed"):
        comm.barrier()
    with pytest.raises(ValueError, match="may only hold"):
        shm.ShmComm("bad/key", 0, 0, 1)
    assert _leftovers(key) == []


# ---- multi-process: correctness -------------------------------------------------------------------


def _check_sizes(comm: shm.ShmComm, index: int, size: int, numel: int, dtype: torch.dtype, seed: int) -> list[str]:
    problems: list[str] = []

    def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        bad = _mismatch(got, want)
        if bad is not None:
            problems.append(f"rank {index} chunk {comm.name} {what} {dtype} numel={numel}: {bad}")

    xs = _inputs(size, size * numel, dtype, seed)
    out = torch.empty(size * numel, dtype=dtype)
    comm.all_gather(out, xs[index][:numel])
    check("all_gather", out, torch.cat([x[:numel] for x in xs]))
    for root in range(size):
        t = xs[index][:numel].clone()
        comm.broadcast(t, root)
        check(f"broadcast from {root}", t, xs[root][:numel])
    if not dtype.is_floating_point:
        return problems
    for op in ("sum", "avg"):
        want = _reference(xs, op)
        part = torch.empty(numel, dtype=dtype)
        comm.reduce_scatter(part, xs[index], op)
        check(f"reduce_scatter {op}", part, want[index * numel : (index + 1) * numel])
        t = xs[index].clone()
        comm.all_reduce(t, op)
        check(f"all_reduce {op}", t, want)
        cut = [_as_spans(x, seed + r) for r, x in enumerate(xs)]
        comm.reduce_scatter_spans(part, cut[index][0], op)
        want = _reference([equal for _, equal in cut], op)
        check(f"reduce_scatter_spans {op}", part, want[index * numel : (index + 1) * numel])
    return problems


def _case_collectives(index: int, size: int, key: str, seed: int) -> list[str]:
    problems: list[str] = []
    with (
        shm.ShmComm(key, "chunk1m", index, size, timeout_s=30) as big,
        shm.ShmComm(key, "chunk64k", index, size, timeout_s=30, chunk_bytes=64 << 10) as small,
    ):
        for comm in (big, small):
            for numel in (0, 1, 1001, 50_003):
                for dtype in (*FLOAT_DTYPES, torch.int64):
                    problems += _check_sizes(comm, index, size, numel, dtype, seed)
        small.set_patient(True)  # sleep at once in every wait: same results
        problems += _check_sizes(small, index, size, 50_003, torch.bfloat16, seed)
        problems += _check_large(big, index, size, seed)
        problems += _check_aliasing_and_thread(big, index, size, seed)
    return problems


def _check_large(comm: shm.ShmComm, index: int, size: int, seed: int) -> list[str]:
    """Buffers of 16 MiB and more (many 1 MiB chunks), odd element counts."""
    problems = []
    numel = 16 * MiB // 4 // size + 3  # per-rank block; the full buffer is >= 16 MiB in fp32
    xs = _inputs(size, size * numel, torch.float32, seed)
    out = torch.empty(size * numel)
    comm.all_gather(out, xs[index][:numel])
    problems.append(("all_gather fp32", _mismatch(out, torch.cat([x[:numel] for x in xs]))))
    part = torch.empty(numel)
    comm.reduce_scatter(part, xs[index], "sum")
    problems.append(("reduce_scatter fp32 sum", _mismatch(part, _reference(xs, "sum")[index * numel :][:numel])))
    t = xs[index].clone()
    comm.all_reduce(t, "avg")
    problems.append(("all_reduce fp32 avg", _mismatch(t, _reference(xs, "avg"))))
    hs = _inputs(size, 2 * size * numel, torch.bfloat16, seed + 1)  # twice the elements: 16 MiB+ in bf16
    t = hs[index].clone()
    comm.all_reduce(t, "sum")
    problems.append(("all_reduce bf16 sum", _mismatch(t, _reference(hs, "sum"))))
    part = torch.empty(2 * numel, dtype=torch.bfloat16)
    comm.reduce_scatter(part, hs[index], "avg")
    want = _reference(hs, "avg")[index * 2 * numel :][: 2 * numel]
    problems.append(("reduce_scatter bf16 avg", _mismatch(part, want)))
    cut = [_as_spans(h, seed + r) for r, h in enumerate(hs)]
    comm.reduce_scatter_spans(part, cut[index][0], "avg")
    want = _reference([equal for _, equal in cut], "avg")[index * 2 * numel :][: 2 * numel]
    problems.append(("reduce_scatter_spans bf16 avg", _mismatch(part, want)))
    ints = _inputs(size, 2 * MiB + 1, torch.int64, seed)[size - 1]  # 16 MiB + 8 bytes
    b = ints.clone() if index == size - 1 else torch.zeros_like(ints)
    comm.broadcast(b, size - 1)
    problems.append(("broadcast int64", _mismatch(b, ints)))
    return [f"rank {index} large {what}: {bad}" for what, bad in problems if bad is not None]


def _check_aliasing_and_thread(comm: shm.ShmComm, index: int, size: int, seed: int) -> list[str]:
    problems = []
    numel = 3001
    xs = _inputs(size, size * numel, torch.float32, seed + 1)
    gathered = torch.zeros(size * numel)
    gathered[index * numel : (index + 1) * numel] = xs[index][:numel]
    comm.all_gather(gathered, gathered[index * numel : (index + 1) * numel])  # in place: inp is out's own block
    problems.append(("in-place all_gather", _mismatch(gathered, torch.cat([x[:numel] for x in xs]))))
    buf = xs[index].clone()
    own = buf[index * numel : (index + 1) * numel]
    comm.reduce_scatter(own, buf, "sum")  # in place: out is inp's own block
    problems.append(("in-place reduce_scatter", _mismatch(own, _reference(xs, "sum")[index * numel :][:numel])))
    t = xs[index].clone()
    worker = threading.Thread(target=comm.all_reduce, args=(t, "sum"))
    worker.start()
    worker.join(timeout=30)
    problems.append(("all_reduce on a thread", _mismatch(t, _reference(xs, "sum"))))
    return [f"rank {index} {what}: {bad}" for what, bad in problems if bad is not None]


@pytest.mark.parametrize("size", [2, 4])
def test_collectives_match_torch(ranks: Callable[[int], Ranks], size: int) -> None:
    key = _key()
    problems = ranks(size).run(_case_collectives, key, 11, timeout=120)
    assert [p for per_rank in problems for p in per_rank] == []
    assert _leftovers(key) == []


# ---- multi-process: failures become errors, never hangs, never leaked segments -------------------


def _case_missing_at_connect(index: int, size: int, key: str, missing: int, timeout_s: float) -> str | None:
    if index == missing:
        return None
    try:
        shm.ShmComm(key, "g", index, size, timeout_s=timeout_s)
    except shm.ShmTimeoutError as exc:
        return str(exc)
    return "connected"


@pytest.mark.parametrize(("size", "missing"), [(4, 3), (2, 0)])
def test_peer_missing_at_connect_times_out(ranks: Callable[[int], Ranks], size: int, missing: int) -> None:
    key = _key()
    # 2 s: nothing here needs to watch the wait (the segment's mode while peers wait is
    # test_segment_is_private_while_peers_wait_for_a_late_rank's, which needs no clock).
    timeout_s = 2
    results = ranks(size).run(_case_missing_at_connect, key, missing, timeout_s, timeout=60)
    for index, message in enumerate(results):
        if index == missing:
            continue
        # A timeout, naming the missing rank and the 2 s it was given (no clock read here).
        expected = f"rank {missing} (local index) did not arrive within {timeout_s} s"
        assert message is not None and expected in message, message
    assert _leftovers(key) == []


def _case_late_at_connect(index: int, size: int, key: str, late: int) -> str | int:
    """Rank `late` arrives only once it has seen the segment the others wait in, and reports its mode."""
    mode = None
    if index == late:
        # The others wait up to 60 s for this rank, so the segment is there to be seen; the deadline
        # only bounds the loop if it never appears (then the test fails on the mode).
        deadline = time.monotonic() + 60
        while mode is None and time.monotonic() < deadline:
            for name in _leftovers(key):
                with contextlib.suppress(FileNotFoundError):
                    mode = stat.S_IMODE((DEV_SHM / name).stat().st_mode)
            time.sleep(0.01)
    with shm.ShmComm(key, "g", index, size, timeout_s=60):
        pass
    return "connected" if mode is None else mode


def test_segment_is_private_while_peers_wait_for_a_late_rank(ranks: Callable[[int], Ranks]) -> None:
    """While ranks 0-2 wait for rank 3, their segment exists with mode 0600 (owner only); once rank 3
    arrives everyone connects, and closing leaves nothing in /dev/shm."""
    key = _key()
    results = ranks(4).run(_case_late_at_connect, key, 3, timeout=120)
    assert results[:3] == ["connected"] * 3, results
    assert results[3] == 0o600, f"segment mode {results[3]!r} (None: never seen), want 0o600"
    assert _leftovers(key) == []


def _case_missing_in_collective(index: int, size: int, key: str) -> str:
    comm = shm.ShmComm(key, "g", index, size, timeout_s=2.0)
    try:
        if index == size - 1:
            time.sleep(3.0)  # never joins the all_reduce below, and stays alive (not closed)
            comm.barrier()  # by now the others aborted the communicator: this fails at once
        else:
            comm.all_reduce(torch.ones(10_000), "sum")
    except shm.ShmTimeoutError as exc:
        return str(exc)
    finally:
        comm.close()
    return "finished"


def test_peer_missing_in_collective_times_out(ranks: Callable[[int], Ranks]) -> None:
    key = _key()
    message, late_message = ranks(2).run(_case_missing_in_collective, key, timeout=60)
    # Rank 0 timed out (2 s) before rank 1 came (3 s): had it still waited, rank 1's barrier would
    # have met its all_reduce ("called a different collective"). Rank 1 then failed at once on the
    # abort rank 0 left, not on a timeout of its own: its error is the one rank 0 reported.
    assert "shm all_reduce: rank 1 (local index) did not arrive within 2 s" in message
    assert "shm barrier: rank 1 (local index) did not arrive" in late_message and "reported by rank 0" in late_message


def _case_mismatched_sizes(index: int, size: int, key: str) -> str:
    # A timeout far past the test's bound on the run: waiting for it would fail as a hang.
    with shm.ShmComm(key, "g", index, size, timeout_s=600.0) as comm:
        x = torch.zeros(10 + index)
        try:
            comm.all_gather(torch.empty(size * x.numel()), x)
        except shm.ShmError as exc:
            return str(exc)
    return "no error"


def test_mismatched_collectives_fail_on_every_rank(ranks: Callable[[int], Ranks]) -> None:
    messages = ranks(2).run(_case_mismatched_sizes, _key(), timeout=60)
    assert all("called a different collective" in m for m in messages), messages


def _case_loop_until_error(index: int, size: int, key: str, ready_dir: str) -> tuple[str, str]:
    comm = shm.ShmComm(key, "g", index, size, timeout_s=30.0)
    t = torch.randn(300_000)
    for _ in range(5):
        comm.all_reduce(t, "avg")
    Path(ready_dir, f"ready{index}").touch()
    try:
        while True:
            comm.all_reduce(t, "avg")
    except shm.ShmError as exc:
        return type(exc).__name__, str(exc)
    finally:
        comm.close()


def test_sigkilled_rank_errors_survivors_and_leaks_nothing(ranks: Callable[[int], Ranks]) -> None:
    key, victim = _key(), 2
    pool = ranks(4)
    with tempfile.TemporaryDirectory() as ready_dir:
        pool.start(_case_loop_until_error, key, ready_dir)
        deadline = time.monotonic() + 120  # a bound on a hang, not a budget
        while len(list(Path(ready_dir).iterdir())) < pool.size:
            assert time.monotonic() < deadline, "ranks never got going"
            time.sleep(0.01)
        os.kill(pool.procs[victim].pid, signal.SIGKILL)  # not reaped until later: a zombie, as in real jobs
        survivors = [i for i in range(pool.size) if i != victim]
        results = pool.collect(timeout=60, indices=survivors)
    pool.close()
    # ShmPeerError ("died") comes from the liveness check; waiting out the 30 s timeout would have
    # raised ShmTimeoutError instead: the kind tells them apart, no clock needed.
    for kind, message in results:
        assert kind == "ShmPeerError" and f"rank {victim} (local index" in message and "died" in message, message
    assert _leftovers(key) == []


# ---- trust: only the job's own user creates or attaches a segment ([Note: shm trust]) -------------

CHUNK = 4096
SEGMENT_BYTES = 4096 + 2 * 2 * CHUNK  # 2 ranks: header page + 2 slots of CHUNK per rank


def _in_child_as(uid: int, gid: int, fn: Callable[[], None]) -> int:
    """Run `fn` in a forked child that switched to uid/gid for good; its exit code (0: fn returned)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (child)
        code = 1
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            fn()
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _forge_segment(path: Path, mode: int) -> None:
    """A segment that a pre-fix joiner would have attached: sized, initialised for 2 ranks of CHUNK,
    rank 0 "attached" by a live pid (this test's), so the joiner would write its pid and unlink it."""
    header = bytearray(SEGMENT_BYTES)
    struct.pack_into("<IIIIQQQI", header, 0, 0x53504D31, 1, 2, 2, CHUNK, SEGMENT_BYTES, 4096, 1)
    struct.pack_into("<Ii", header, 128, 0, os.getppid())  # rank_ctl[0]: cnt, pid (the test process)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    try:
        os.fchmod(fd, mode)  # past the umask
        os.write(fd, bytes(header))
    finally:
        os.close(fd)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching to the attacker's uid needs root")


@needs_root
@pytest.mark.parametrize("mode", [0o644, 0o600], ids=["0644", "0600"])
@pytest.mark.parametrize("index", [0, 1], ids=["creator", "joiner"])
def test_a_name_taken_by_another_user_is_refused_and_left_alone(index: int, mode: int) -> None:
    nobody = pwd.getpwnam("nobody")
    key = _key()
    path = DEV_SHM / shm.segment_name(key, "g")
    assert _in_child_as(nobody.pw_uid, nobody.pw_gid, lambda: _forge_segment(path, mode)) == 0
    try:
        before = path.read_bytes()
        # refused at once, not after the timeout: that would raise ShmTimeoutError, not this
        with pytest.raises(shm.ShmForeignSegmentError) as caught:
            shm.ShmComm(key, "g", index, 2, timeout_s=5.0, chunk_bytes=CHUNK)
        message = str(caught.value)
        assert f"/dev/shm/{path.name}" in message and "owned by uid 65534 (nobody)" in message, message
        assert f"mode {mode:04o}" in message and "this job runs as uid 0 (root)" in message, message
        assert path.exists() and path.read_bytes() == before  # never attached, never unlinked
        assert path.stat().st_uid == nobody.pw_uid
    finally:
        path.unlink(missing_ok=True)


@needs_root
def test_a_non_root_job_names_the_owner_of_a_segment_it_cannot_open() -> None:
    """A job that is not root cannot even open another user's 0600 segment (EACCES): same refusal."""
    nobody = pwd.getpwnam("nobody")
    key, job_uid = _key(), 54321  # a uid with no passwd entry: named by number
    path = DEV_SHM / shm.segment_name(key, "g")
    assert _in_child_as(nobody.pw_uid, nobody.pw_gid, lambda: _forge_segment(path, 0o600)) == 0
    verdict = Path(tempfile.mkdtemp()) / "verdict"
    os.chmod(verdict.parent, 0o777)

    def join() -> None:
        try:
            shm.ShmComm(key, "g", 1, 2, timeout_s=5.0, chunk_bytes=CHUNK)
        except shm.ShmForeignSegmentError as exc:
            verdict.write_text(str(exc))

    try:
        assert _in_child_as(job_uid, job_uid, join) == 0
        message = verdict.read_text()
        assert f"/dev/shm/{path.name}" in message and "owned by uid 65534 (nobody)" in message, message
        assert f"this job runs as uid {job_uid} " in message, message
        assert path.exists() and path.stat().st_uid == nobody.pw_uid
    finally:
        path.unlink(missing_ok=True)
        verdict.unlink(missing_ok=True)
        verdict.parent.rmdir()


def test_a_segment_of_ours_open_to_others_is_refused() -> None:
    key = _key()
    path = DEV_SHM / shm.segment_name(key, "g")
    _forge_segment(path, 0o640)  # our uid, but group-readable: someone made it accessible
    try:
        with pytest.raises(shm.ShmForeignSegmentError, match=r"mode 0640"):
            shm.ShmComm(key, "g", 1, 2, timeout_s=5.0, chunk_bytes=CHUNK)
        assert path.exists()
    finally:
        path.unlink(missing_ok=True)


def test_a_leftover_segment_of_ours_names_its_dev_shm_path() -> None:
    key = _key()
    path = DEV_SHM / shm.segment_name(key, "g")
    _forge_segment(path, 0o600)
    try:
        with pytest.raises(shm.ShmError, match=rf"remove /dev/shm/{path.name}\)"):
            shm.ShmComm(key, "g", 0, 2, timeout_s=5.0, chunk_bytes=CHUNK)
    finally:
        path.unlink(missing_ok=True)


def test_engine_segment_names_reveal_neither_the_secret_nor_other_groups_names() -> None:
    from shardpar.collectives.smddp import _agree_on_job, segment_key

    secret = _agree_on_job(False, 0, 1, 1)  # rank 0's draw, as the engine makes it
    assert len(secret) == 32 and int(secret, 16) >= 0 and secret != _agree_on_job(False, 0, 1, 1)
    names = {ranks: shm.segment_name(segment_key(secret, ranks), "smddp") for ranks in [(0, 1), (2, 3), (0, 2)]}
    assert len(set(names.values())) == 3 and all(secret not in name for name in names.values()), names
    assert names[(0, 1)] == shm.segment_name(segment_key(secret, (0, 1)), "smddp")  # every member agrees
    assert segment_key(secret, (0, 1)) != segment_key(secret[::-1], (0, 1))  # another job: other names
