"""`shardpar demo | env` -- the command-line entry point."""

from __future__ import annotations

import argparse
import platform
import sys
import time
from typing import Any

from shardpar.topology import plan


def _demo_rank(sdp: int, numel: int) -> dict[str, Any]:
    import torch

    import shardpar as smp
    from shardpar.collectives import ReduceOp

    smp.init({"sharded_data_parallel_degree": sdp})
    eng, topo = smp.get_engine(), smp.get_topology()
    shard = torch.full((numel,), float(smp.rank()))
    full = torch.empty(numel * sdp)
    timings: dict[str, float] = {}
    smp.comm_stats().begin_step()
    start = time.perf_counter()
    eng.all_gather(full, shard, topo.sharding)
    timings["all_gather"] = time.perf_counter() - start
    expected = torch.cat([torch.full((numel,), float(r)) for r in topo.sharding.ranks])
    if not torch.equal(full, expected):
        raise AssertionError("all_gather returned wrong data")
    start = time.perf_counter()
    eng.reduce_scatter(shard, full, topo.sharding, op=ReduceOp.AVG)
    timings["reduce_scatter"] = time.perf_counter() - start
    start = time.perf_counter()
    eng.all_reduce(shard, topo.replication, op=ReduceOp.AVG)
    timings["all_reduce"] = time.perf_counter() - start
    records = smp.comm_stats().begin_step()
    return {
        "rank": smp.rank(),
        "sdp_rank": smp.sdp_rank(),
        "replica": smp.replica_rank(),
        "timings": timings,
        "bytes": {r.op: r.bytes for r in records},
    }


def demo(args: argparse.Namespace) -> int:
    from shardpar.launcher import launch_local

    world, sdp = args.nprocs, args.sdp
    p = plan(world, 1, sdp)
    print(f"shardpar demo: {world} CPU ranks on this machine, sharded_data_parallel_degree={sdp}")
    print(f"  sharding groups (parameters are split across each): {list(p.sharding_groups)}")
    print(f"  replication groups (same shard, averaged at the accumulation boundary): {list(p.replication_groups)}")
    numel = args.mib * 1024 * 1024 // 4
    print(f"  running AllGather -> ReduceScatter -> AllReduce of a {args.mib} MiB fp32 shard per rank ...")
    results = launch_local(_demo_rank, world, sdp, numel)
    for res in results:
        t = res["timings"]
        print(
            f"  rank {res['rank']} (replica {res['replica']}, shard {res['sdp_rank']}): "
            + ", ".join(f"{op} {t[op] * 1e3:.1f} ms / {res['bytes'][op] / 2**20:.0f} MiB" for op in t)
        )
    print("  every gathered buffer matched the concatenation of the shards; communication was counted per op.")
    return 0


def env(args: argparse.Namespace) -> int:
    import torch

    import shardpar

    print(f"shardpar {shardpar.__version__}  python {platform.python_version()}  torch {torch.__version__}")
    print(f"cuda available: {torch.cuda.is_available()}")
    p = plan(args.world, args.tp, args.sdp, args.ranks_per_node)
    print(f"topology preview (world {p.world}, tp {p.tp}, sdp {p.sdp}, {p.ranks_per_node} ranks/node):")
    for kind in ("tp", "rdp", "sharding", "replication", "node"):
        groups = p.all_groups(kind)
        shown = ", ".join(map(str, groups[:4])) + (" ..." if len(groups) > 4 else "")
        print(f"  {kind:12s} {len(groups):4d} x {len(groups[0])}: {shown}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardpar", description="MiCS-style sharded data parallelism")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run a short multi-rank job on this machine")
    d.add_argument("--nprocs", type=int, default=4)
    d.add_argument("--sdp", type=int, default=2)
    d.add_argument("--mib", type=int, default=4)
    d.set_defaults(func=demo)
    e = sub.add_parser("env", help="versions and a topology preview")
    e.add_argument("--world", type=int, default=8)
    e.add_argument("--tp", type=int, default=1)
    e.add_argument("--sdp", type=int, default=2)
    e.add_argument("--ranks-per-node", type=int, default=None)
    e.set_defaults(func=env)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as err:
        print(f"shardpar: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
