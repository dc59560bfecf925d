"""`shardpar demo | env` -- the command-line entry point."""

from __future__ import annotations

import argparse
import platform
import sys

from shardpar.topology import plan


def demo(args: argparse.Namespace) -> int:
    from shardpar.demo import demo_rank
    from shardpar.launcher import launch_local

    world, sdp = args.nprocs, args.sdp
    p = plan(world, 1, sdp)
    print(f"shardpar demo: training a tiny GPT-NeoX on {world} CPU ranks, sharded_data_parallel_degree={sdp}")
    print(f"  sharding groups (each holds one copy of the model, split {sdp} ways): {list(p.sharding_groups)}")
    print(f"  replication groups (same shard, gradients averaged at the step boundary): {list(p.replication_groups)}")
    results = launch_local(demo_rank, world, sdp, args.steps, args.batch, args.seq)
    first = results[0]
    history = first["history"]
    print(
        f"  model: {first['numel']:,} parameters; each rank keeps {first['shard']:,} in its shards "
        f"(~1/{sdp} of the sharded ones)"
    )
    print(
        f"  loss {history[0]:.3f} -> {history[-1]:.3f} over {len(history)} steps "
        f"({'falling' if history[-1] < history[0] else 'NOT falling'})"
    )
    return 0 if history[-1] < history[0] else 1


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
    d.add_argument("--steps", type=int, default=60)
    d.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    d.add_argument("--seq", type=int, default=64)
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
