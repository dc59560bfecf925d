"""Emulated nodes on one machine: network namespaces joined by veth links shaped with `tc ... tbf`.

Each node is a network namespace with lo up and one link (MTU 9000, so header bytes stay ~1 % of the
payload and the link's byte counters are within ~1 % of what the collectives moved). Two nodes are one
veth pair; more nodes each get a veth to a hub namespace holding a bridge. Both directions of every
link are shaped by a tbf qdisc at the given rate. `launch` runs one `torchrun --nnodes N --node-rank i`
per namespace with GLOO_SOCKET_IFNAME set to the node's link: gloo between two ranks of one node goes
to the node's own address, which the kernel routes over lo, so only node-to-node traffic crosses
(and is counted by) the link. Ranks read their node's link counters from /sys/class/net, which
`ip netns exec` remounts for the namespace.

Needs root, `ip` and `tc` (iproute2) and the tbf qdisc; `available()` says why not. Names carry this
process's pid (spnodes<pid>-...); addresses are 10.213.<k>.x, only inside the namespaces made here.
Everything is deleted on exit, on an exception, on SIGINT/SIGTERM (handlers installed while a set of
nodes is up), and at interpreter exit (atexit); namespaces of a dead pid are removed by `remove_stale`.

    python benchmarks/emulated_nodes.py --rate-mbit 300 --nodes 2    # shaping self-test (sockets)
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

MTU = 9000
PREFIX = "spnodes"
RESULT_DIR_ENV = "SPNODES_RESULT_DIR"  # where each rank writes rank<R>.json (write_result)
LINK_ENV = "SPNODES_LINK"  # the node's link name inside its namespace
_LIVE: set[str] = set()  # namespaces this process created and has not deleted yet


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")


def _tc(ns: str, *args: str) -> None:
    cmd = ["ip", "netns", "exec", ns, "tc", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")


def tbf_args(rate_mbit: float) -> list[str]:
    """tbf parameters for `rate_mbit`. The bucket holds 4 ms of traffic (>= 64 KiB, several jumbo
    frames: a bucket below one GSO/jumbo frame stalls the link) and the queue 50 ms: TCP at these
    rates then sees no tail drops during a collective's burst, only queueing, and keeps the link at
    its rate (checked by `selftest`)."""
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(64 * 1024, int(rate_bytes * 0.004))
    return ["rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms"]


@dataclass(frozen=True)
class Node:
    index: int
    ns: str  # network namespace
    link: str  # its link's name inside the namespace
    addr: str  # its address on the link


class EmulatedNodes:
    """N namespaces joined by shaped links; a context manager (deletes everything on exit)."""

    def __init__(self, count: int, rate_mbit: float | None, *, subnet: int | None = None) -> None:
        if count < 1:
            raise ValueError(f"{count} nodes")
        self.count, self.rate_mbit = count, rate_mbit
        pid = os.getpid()
        self.subnet = subnet if subnet is not None else pid % 250 + 1  # any: the addresses live in our namespaces
        self.prefix = f"{PREFIX}{pid}-{time.monotonic_ns() % 10**6}"
        self.nodes = [Node(i, f"{self.prefix}-n{i}", f"link{i}", f"10.213.{self.subnet}.{i + 1}") for i in range(count)]
        self.hub = f"{self.prefix}-hub" if count > 2 else None
        self._old_handlers: dict[int, Any] = {}

    # ---- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> EmulatedNodes:
        self._install_handlers()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for ns in [n.ns for n in self.nodes] + ([self.hub] if self.hub else []):
            if ns in _LIVE:
                _delete_ns(ns)
        self._restore_handlers()

    def _install_handlers(self) -> None:
        # SIGTERM's default action would skip every `finally`; as SystemExit the teardown runs.
        # Only the main thread may set handlers (a test runner's worker thread keeps the defaults).
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, _exit_on_signal)

    def _restore_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    def _create(self) -> None:
        for ns in [n.ns for n in self.nodes] + ([self.hub] if self.hub else []):
            _ip("netns", "add", ns)
            _LIVE.add(ns)
            _ip("link", "set", "lo", "up", ns=ns)
        if self.count == 2:
            a, b = self.nodes
            # created directly inside the namespaces: no name in the host's namespace at any time
            _ip("link", "add", a.link, "netns", a.ns, "type", "veth", "peer", "name", b.link, "netns", b.ns)
            shaped = [(a.ns, a.link), (b.ns, b.link)]  # each end's egress is one direction
        else:
            shaped = []
            if self.hub:
                _ip("link", "add", "br0", "type", "bridge", ns=self.hub)
                _ip("link", "set", "br0", "mtu", str(MTU), "up", ns=self.hub)
            for n in self.nodes:
                if self.hub is None:  # one node: a veth to itself (no dummy module needed); nothing crosses it
                    _ip("link", "add", n.link, "type", "veth", "peer", "name", f"{n.link}p", ns=n.ns)
                    _ip("link", "set", f"{n.link}p", "up", ns=n.ns)
                    continue
                peer = f"hub{n.index}"
                _ip("link", "add", n.link, "netns", n.ns, "type", "veth", "peer", "name", peer, "netns", self.hub)
                _ip("link", "set", peer, "master", "br0", "mtu", str(MTU), "up", ns=self.hub)
                shaped += [(n.ns, n.link), (self.hub, peer)]
        for n in self.nodes:
            _ip("link", "set", n.link, "mtu", str(MTU), "up", ns=n.ns)
            _ip("addr", "add", f"{n.addr}/24", "dev", n.link, ns=n.ns)
        if self.rate_mbit:
            for ns, dev in shaped:
                _tc(ns, "qdisc", "replace", "dev", dev, "root", "tbf", *tbf_args(self.rate_mbit))

    # ---- counters -----------------------------------------------------------------------------

    def counters(self, node: int) -> tuple[int, int]:
        """(tx, rx) bytes of node `node`'s link, read from outside (ip -s -j link)."""
        n = self.nodes[node]
        out = subprocess.run(
            ["ip", "-n", n.ns, "-s", "-j", "link", "show", n.link], capture_output=True, text=True, check=True
        ).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


def _delete_ns(ns: str) -> None:
    # deleting a namespace deletes the links in it (a veth takes its peer along)
    subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
    _LIVE.discard(ns)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


@atexit.register
def _delete_leftovers() -> None:
    for ns in list(_LIVE):
        _delete_ns(ns)


def remove_stale() -> list[str]:
    """Delete namespaces named by this module for a process that no longer exists (killed by SIGKILL)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    removed = []
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)-\d+-(n\d+|hub)", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _delete_ns(name)
            removed.append(name)
    return removed


_AVAILABLE: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    """(True, "") when emulated nodes can be made here, else (False, why): creates and deletes a pair."""
    global _AVAILABLE
    if _AVAILABLE is None:
        _AVAILABLE = _probe()
    return _AVAILABLE


def _probe() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, "emulated nodes need Linux network namespaces"
    if os.geteuid() != 0:
        return False, "emulated nodes need root (network namespaces, veth links, tc qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"emulated nodes need `{tool}` (iproute2)"
    try:
        remove_stale()
        with EmulatedNodes(2, 100.0):
            pass
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        return False, f"emulated nodes unavailable (network namespace, veth or tbf): {err}"
    return True, ""


# ---- launching one torchrun per node ------------------------------------------------------------


def write_result(result: dict[str, Any]) -> None:
    """Called by a rank: its JSON result, collected by `launch`."""
    path = os.path.join(os.environ[RESULT_DIR_ENV], f"rank{os.environ['RANK']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)  # a half-written file is never read


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its workers in sessions of their own, so killing
    torchrun's process group would miss them)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in _listdir(f"/proc/{p}/task"):
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    victims = [*_descendants(proc.pid), proc.pid]  # collected before anything exits and re-parents
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
            return


class LaunchError(RuntimeError):
    pass


def launch(
    nodes: EmulatedNodes,
    ranks_per_node: int,
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = 600.0,
    port: int = 29500,
) -> list[dict[str, Any]]:
    """Run `python argv...` as N x L ranks (one torchrun per node, inside its namespace) and return each
    rank's result (written with `write_result`) in rank order. Any failure or the timeout kills every
    process and raises LaunchError with the nodes' output tails."""
    result_dir = tempfile.mkdtemp(prefix="spnodes_results_")
    procs: list[subprocess.Popen[bytes]] = []
    logs = [os.path.join(result_dir, f"node{n.index}.log") for n in nodes.nodes]
    try:
        for n, log in zip(nodes.nodes, logs, strict=True):
            cmd = ["ip", "netns", "exec", n.ns, sys.executable, "-m", "torch.distributed.run"]
            cmd += [f"--nnodes={nodes.count}", f"--node-rank={n.index}", f"--nproc-per-node={ranks_per_node}"]
            cmd += [f"--master-addr={nodes.nodes[0].addr}", f"--master-port={port}", "--max-restarts=0", *argv]
            penv = {**os.environ, **(env or {}), RESULT_DIR_ENV: result_dir, LINK_ENV: n.link}
            penv.update(GLOO_SOCKET_IFNAME=n.link, OMP_NUM_THREADS="1")
            with open(log, "wb") as out:
                procs.append(subprocess.Popen(cmd, env=penv, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = (
                    f"node {failed[0]} exited {procs[failed[0]].returncode}" if failed else f"timeout {timeout_s:.0f} s"
                )
                raise LaunchError(f"{why}\n{_tails(logs)}")
            time.sleep(0.2)
        if any(p.returncode != 0 for p in procs):
            raise LaunchError(f"exit codes {[p.returncode for p in procs]}\n{_tails(logs)}")
        world = nodes.count * ranks_per_node
        results = []
        for r in range(world):
            path = os.path.join(result_dir, f"rank{r}.json")
            if not os.path.exists(path):
                raise LaunchError(f"rank {r} wrote no result\n{_tails(logs)}")
            with open(path) as f:
                results.append(json.load(f))
        return results
    finally:
        for p in procs:
            _kill_tree(p)
        shutil.rmtree(result_dir, ignore_errors=True)


def _tails(logs: list[str], lines: int = 40) -> str:
    parts = []
    for i, log in enumerate(logs):
        with contextlib.suppress(OSError), open(log, errors="replace") as f:
            parts.append(f"--- node {i} ---\n" + "".join(f.readlines()[-lines:]))
    return "\n".join(parts)


# ---- self-test: does the shaping hold the rate? ----------------------------------------------------

_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5201)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    t0 = t0 or time.perf_counter(); n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""
_SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5201)); buf = b"x" * (1 << 20); n = int(sys.argv[2])
for _ in range(n): c.sendall(buf)
c.close()
"""


def selftest(count: int, rate_mbit: float, mib: int) -> dict[str, float]:
    """Send `mib` MiB from node 1 to node 0 over TCP: achieved Mbit/s and counted bytes / payload."""
    with EmulatedNodes(count, rate_mbit) as nodes:
        a, b = nodes.nodes[0], nodes.nodes[1]
        tx0 = nodes.counters(b.index)[0]
        sink = subprocess.Popen(
            ["ip", "netns", "exec", a.ns, sys.executable, "-c", _SINK, a.addr], stdout=subprocess.PIPE, text=True
        )
        try:
            assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
            cmd = ["ip", "netns", "exec", b.ns, sys.executable, "-c", _SOURCE, a.addr, str(mib)]
            subprocess.run(cmd, check=True, timeout=600)
            got, secs = sink.stdout.readline().split()
        finally:
            sink.kill()
            sink.wait()
        counted = nodes.counters(b.index)[0] - tx0
    return {"mbit_s": int(got) * 8 / float(secs) / 1e6, "counted_over_payload": counted / int(got)}


def main() -> int:
    p = argparse.ArgumentParser(description="Emulated nodes: shaping self-test over TCP sockets")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rate-mbit", type=float, default=300.0)
    p.add_argument("--mib", type=int, default=64)
    args = p.parse_args()
    ok, why = available()
    if not ok:
        print(f"skipped: {why}")
        return 0
    print(json.dumps(selftest(args.nodes, args.rate_mbit, args.mib)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
