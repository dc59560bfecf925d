"""`shardpar demo | estimate | env` -- the command-line entry point."""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from shardpar.topology import plan

# ---- demo ----------------------------------------------------------------------------------------


def demo(args: argparse.Namespace) -> int:
    from shardpar.cli.demo import demo_options, demo_rank
    from shardpar.cli.launcher import launch_local

    world, sdp = args.nprocs, args.sdp
    p = plan(world, 1, sdp)
    opts = demo_options(sdp=sdp, steps=args.steps, batch=args.batch, seq=args.seq, out=args.out)
    print(f"shardpar demo: training a tiny GPT-NeoX on {world} CPU ranks, sharded_data_parallel_degree={sdp}")
    print(f"  sharding groups (each holds one copy of the model, split {sdp} ways): {list(p.sharding_groups)}")
    print(f"  replication groups (same shard, gradients averaged at the step boundary): {list(p.replication_groups)}")
    print(f"  corpus: Python's own standard-library source, byte-level; {args.steps} steps", flush=True)
    first = launch_local(demo_rank, world, opts)[0]
    return _demo_summary(first, sdp)


def _demo_summary(r: Any, sdp: int) -> int:
    falling = r.losses[-1] < r.losses[0]
    print(
        f"\n  model: {r.num_params:,} parameters; each rank keeps {r.shard_numel:,} in its shards (~1/{sdp} of the "
        f"sharded ones)"
    )
    print(
        f"  loss {r.losses[0]:.3f} -> {r.losses[-1]:.3f} over {len(r.losses)} steps "
        f"({'falling' if falling else 'NOT falling'}); median {r.tokens_per_s:,.0f} tokens/s"
    )
    print(
        f"  model states per rank: {r.model_state_bytes / 2**20:.2f} MiB measured, "
        f"{r.estimated_model_state_bytes / 2**20:.2f} MiB by `shardpar estimate`; peak RSS per rank "
        f"{min(r.rss_mib):.0f}-{max(r.rss_mib):.0f} MiB"
    )
    print(f"  loss curve:   {r.plot}")
    print(f"  metrics:      {r.metrics}  (one JSON line per step)")
    if r.checkpoint:
        print(f"  checkpoint:   {r.checkpoint}")
        print(f"                continue: torchrun --nproc-per-node {len(r.rss_mib)} recipes/train_causal_lm.py "
              f"--config {r.out}/options.json --resume --steps {2 * len(r.losses)}")  # fmt: skip
    print(f"  hf export:    {r.export or 'none (see the messages above)'}")
    for note in r.notes:
        print(f"  note:         {note.splitlines()[0]}")
    if r.export:
        print(f"                AutoModelForCausalLM.from_pretrained({r.export!r})")
    if r.sample:
        print("  sample:       " + r.sample.replace("\n", "\n                "))
    return 0 if falling else 1


# ---- estimate ------------------------------------------------------------------------------------


def estimate(args: argparse.Namespace) -> int:
    from shardpar.cli import estimate as est
    from shardpar.config import Config

    if args.reference:
        return _reference_table(est)
    world, device = _world_and_device(args, est)
    tp = _tp(args, est, world)
    # the layout rules smp.init applies (prescaled_batch: smp.init requires it with tp > 1)
    layout = Config(sharded_data_parallel_degree=args.sdp or 1, tensor_parallel_degree=tp, prescaled_batch=True)
    layout.check_world(world)
    shape = _shape(args, est)
    setup = est.Setup(
        sdp=args.sdp or 1, tp=tp, batch=args.batch, seq=args.seq, precision=args.precision,
        activation_checkpointing=args.activation_checkpointing or args.activation_offloading,
        activation_offloading=args.activation_offloading, flash_attention=not args.eager_attention,
        activation_loading_horizon=args.activation_loading_horizon,
        optimizer=args.optimizer, max_live_parameters=int(args.max_live_parameters),
        reduce_bucket_size=int(args.reduce_bucket_size), device=device,
        shard_optimizer_state=args.shard_optimizer_state, world=world, accum=args.accum,
        ranks_per_node=args.ranks_per_node or (min(world, 8) if args.link_gbps is not None else None),
        node_secondary_shard=args.node_secondary_shard, defer_cross_node_reduce=args.defer_cross_node_reduce,
        quantize_cross_node=args.quantize_cross_node,
    )  # fmt: skip
    sos = ", shard_optimizer_state" if args.shard_optimizer_state else ""
    print(f"{shape.name}: {shape.num_params:,} parameters, {shape.num_layers} layers, hidden {shape.hidden}; "
          f"world {world}, tp {tp}, batch {args.batch} x seq {args.seq}, {args.precision}, {device}{sos}")  # fmt: skip
    if device == "cpu":
        print("  (CPU: RSS with MALLOC_MMAP_THRESHOLD_=1048576, freed blocks going back to the OS; with glibc's "
              "defaults its heap keeps more, +11 to +32 % measured at 162M: docs/performance.md, Memory)")  # fmt: skip
    if args.lora_rank is not None or args.frozen_dtype is not None:
        from shardpar.cli.lora_estimate import print_lora

        return print_lora(args, shape, setup, world)
    if args.link_gbps is not None:
        from shardpar.cli.cross_node import print_estimate

        print_estimate(args, shape, setup, world)
    if args.sdp:
        print(est.format_estimate(est.estimate(shape, setup)))
        if args.optimizer in ("muon", "adafactor"):
            from shardpar.cli.owner_estimate import format_owner_plan

            print(format_owner_plan(shape, setup))
        return 0
    return _recommend(est, shape, setup, world)


def _recommend(est: Any, shape: Any, setup: Any, world: int) -> int:
    from shardpar.cli import recommend as rec

    known = setup.capacity is not None  # no capacity (cpu): a table of sizes, no verdict
    print("  sdp   per device")
    for sdp in rec.divisors(world // setup.tp):
        e = est.estimate(shape, replace(setup, sdp=sdp))
        verdict = ("fits" if e.fits else "-") if known else ""
        print(f"  {sdp:4d} {e.total / est.GiB:9.2f} GiB  {verdict}".rstrip())
    if not known:
        print(f"device {setup.device!r} has no known capacity: compare each row with the memory one rank may use")
        return 0
    best = rec.smallest_fitting_sdp(shape, setup, world)
    if best is not None:
        print(f"smallest sharded_data_parallel_degree that fits: {best.setup.sdp}")
        print(est.format_estimate(best))
        return 0
    found = rec.alternatives(shape, setup, world)
    if not found:
        print(f"nothing fits on {world} x {setup.device}, not even with tp up to 8, activation checkpointing and "
              "offloading: use more devices (--nodes, --gpus) or a smaller --batch or --seq")  # fmt: skip
        return 1
    print("nothing fits with these settings; smallest fitting sdp with other choices:")
    for alt in found:
        s = alt.setup
        print(f"  tp {s.tp}, sdp {s.sdp}, activation checkpointing {s.activation_checkpointing}, "
              f"offloading {s.activation_offloading}: {alt.total / est.GiB:.2f} GiB")  # fmt: skip
    return 1


def _reference_table(est: Any) -> int:
    from shardpar.cli import recommend as rec

    print("reference 003 configurations (bf16, activation checkpointing) on their instances:")
    for row in est.REFERENCE_ROWS:
        shape = est.reference_shape(row.model)
        tp = rec.tp_from_global_batch(row.world, row.global_batch, row.mini_batch)
        e = est.estimate(shape, row.setup(tp=tp))
        best = rec.smallest_fitting_sdp(shape, row.setup(tp=tp), row.world)
        offload = " + offload" if row.offload else ""
        print(
            f"  {row.model} x{row.instances} {row.instance_type} seq {row.seq} batch {row.mini_batch} sdp {row.sdp} "
            f"tp {tp}{offload}: {e.total / est.GiB:.1f} GiB -> {'fits' if e.fits else 'does NOT fit'}; "
            f"smallest fitting sdp {best.setup.sdp if best else 'none'}"
        )
        sos = row.setup(tp=tp, shard_optimizer_state=True)
        z = est.estimate(shape, sos)
        zbest = rec.smallest_fitting_sdp(shape, sos, row.world)
        print(
            f"      with shard_optimizer_state ({sos.replicas} replica{'s' if sos.replicas > 1 else ''}): "
            f"model states {e.model_states / est.GiB:.1f} "
            f"-> {z.model_states / est.GiB:.1f} GiB, total {z.total / est.GiB:.1f} GiB -> "
            f"{'fits' if z.fits else 'does NOT fit'}; smallest fitting sdp {zbest.setup.sdp if zbest else 'none'}"
        )
    return 0


def _shape(args: argparse.Namespace, est: Any) -> Any:
    threshold = int(args.persistence_threshold)
    sizes = {"hidden": args.hidden, "num_layers": args.layers, "num_heads": args.heads, "vocab": args.vocab}
    given = {k: v for k, v in sizes.items() if v is not None}
    if args.params is not None:
        return est.shape_from_num_params(args.params, **given, persistence_threshold=threshold)
    if given:  # the other models bring their own dimensions
        flags = " ".join(f"--{_FLAG_OF[k]} {v}" for k, v in given.items())
        model = f"--hf-config {args.hf_config}" if args.hf_config is not None else f"--model {args.model}"
        raise ValueError(
            f"{flags}: these describe a --params model, and {model} brings its own dimensions; drop them, or "
            "describe the model with --params"
        )
    if args.hf_config is not None:
        return _hf_shape(Path(args.hf_config), est, threshold)
    if args.model in est.REFERENCE_MODELS:
        return est.reference_shape(args.model, persistence_threshold=threshold)
    family, _, size = args.model.partition(":")
    from shardpar.cli.demo import recipe

    cfg = recipe("models").hf_config(family, size or "tiny", seq=args.seq)
    return est.shape_from_hf_config(cfg, name=args.model, persistence_threshold=threshold)


_FLAG_OF = {"hidden": "hidden", "num_layers": "layers", "num_heads": "heads", "vocab": "vocab"}


def _hf_shape(given: Path, est: Any, threshold: int) -> Any:
    from transformers import AutoConfig

    path = given / "config.json" if given.is_dir() else given
    if not path.is_file():
        raise ValueError(
            f"--hf-config {str(path)!r} does not exist; give a Hugging Face config.json or the directory holding one"
        )
    cfg = AutoConfig.from_pretrained(str(path))  # given a file, transformers reads that file, whatever its name
    return est.shape_from_hf_config(cfg, name=given.stem, persistence_threshold=threshold)


def _world_and_device(args: argparse.Namespace, est: Any) -> tuple[int, str]:
    if args.device is not None:
        if args.nodes is not None:
            raise ValueError(
                f"--nodes {args.nodes} counts --instance machines; with --device {args.device} give the devices "
                "in all as --gpus"
            )
        return args.gpus or 1, args.device
    if args.gpus is not None:
        raise ValueError(f"--gpus {args.gpus} needs --device (which device); with --instance give --nodes instead")
    if args.instance not in est.INSTANCES:
        raise ValueError(f"--instance {args.instance!r} is not one of {', '.join(est.INSTANCES)}; or give --device")
    per, device = est.INSTANCES[args.instance]
    return (args.nodes or 1) * per, device


def _tp(args: argparse.Namespace, est: Any, world: int) -> int:
    from shardpar.cli import recommend as rec

    if args.global_batch is None:
        return int(args.tp or 1)
    tp = int(rec.tp_from_global_batch(world, args.global_batch, args.batch, args.accum))
    if args.tp is not None and args.tp != tp:
        raise ValueError(
            f"--tp {args.tp} conflicts with --global-batch {args.global_batch}, which gives tp {tp} (world {world} / "
            f"(global batch {args.global_batch} / (batch {args.batch} x accum {args.accum}))); give only one of them"
        )
    print(f"tp {tp}: global batch {args.global_batch} / (batch {args.batch} x accum {args.accum}) "
          f"= {world // tp} data-parallel ranks of {world}")  # fmt: skip
    return tp


# ---- env -----------------------------------------------------------------------------------------


def env(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import shardpar

    print(f"shardpar {shardpar.__version__}  python {platform.python_version()}  torch {torch.__version__}")
    print(
        "packages:  "
        + "  ".join(f"{n} {_version(n)}" for n in ("transformers", "tokenizers", "safetensors", "accelerate"))
    )
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    print(f"cuda available: {torch.cuda.is_available()}" + (f" ({len(gpus)} x {gpus[0]})" if gpus else ""))
    print(f"engines:   native (torch.distributed): gloo {dist.is_gloo_available()}, nccl {dist.is_nccl_available()}")
    print(f"           smddp shared-memory extension: {_shm_status()}")
    print(
        f"features:  checkpoints {_has('shardpar.checkpoint')}, tensor parallelism {_has('shardpar.tensor_parallel')}"
    )
    p = plan(args.world, args.tp, args.sdp, args.ranks_per_node)
    print(f"topology preview (world {p.world}, tp {p.tp}, sdp {p.sdp}, {p.ranks_per_node} ranks/node):")
    for kind in ("tp", "rdp", "sharding", "replication", "node"):
        groups = p.all_groups(kind)
        shown = ", ".join(map(str, groups[:4])) + (" ..." if len(groups) > 4 else "")
        print(f"  {kind:12s} {len(groups):4d} x {len(groups[0])}: {shown}")
    return 0


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "missing"


def _has(module: str) -> str:
    import importlib.util

    return "yes" if importlib.util.find_spec(module) is not None else "not in this build"


def _shm_status() -> str:
    try:
        from shardpar.collectives import shm
    except ImportError as err:
        return f"not in this build ({err})"
    ok, why = shm.available()
    return f"built (kernels: {shm.best_isa()})" if ok else f"NOT built: {why}"


# ---- parser --------------------------------------------------------------------------------------


def _at_least(low: float, *, kind: type = int, why: str = "") -> Callable[[str], Any]:
    """An argparse type: a number >= low (an int, or a float such as 20e9), else a usage error (exit 2)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not low <= value < float("inf"):  # also refuses nan and inf
            rule = f">= {low:g}" if kind is int else f"a finite number >= {low:g}"
            raise argparse.ArgumentTypeError(f"{text} must be {rule}{why}")
        return value

    return parse


_COUNT = _at_least(1)


def _estimate_parser(sub: Any) -> None:
    e = sub.add_parser("estimate", help="per-device memory; the smallest sharding degree that fits")
    what = e.add_mutually_exclusive_group()
    what.add_argument(
        "--model", default="gpt-neox-20b", help="gpt-neox-20b, gpt-neox-65b or FAMILY:SIZE (gpt_neox:tiny)"
    )
    what.add_argument("--hf-config", help="a Hugging Face config.json (or its directory)")
    what.add_argument("--params", type=_at_least(1, kind=float), help="a bare parameter count, e.g. 20e9 (GPT-like)")
    e.add_argument("--hidden", type=_COUNT, help="with --params")
    e.add_argument("--layers", type=_COUNT, help="with --params")
    e.add_argument("--heads", type=_COUNT, help="with --params")
    e.add_argument("--vocab", type=_COUNT, help="with --params (default 50304)")
    e.add_argument("--instance", default="p4d.24xlarge", help="instance type (8 GPUs each)")
    e.add_argument("--nodes", type=_COUNT, help="instances (default 1)")
    e.add_argument("--device", help="instead of --instance: a100-40gb, h100-80gb, ... or cpu")
    e.add_argument("--gpus", type=_COUNT, help="devices in all, with --device")
    e.add_argument("--sdp", type=_COUNT, help="evaluate this degree (default: list all and recommend)")
    e.add_argument("--tp", type=_COUNT, help="tensor-parallel degree (default 1, or from --global-batch)")
    e.add_argument("--global-batch", type=_COUNT, help="derive tp: world / (global batch / (batch x accum))")
    e.add_argument("--batch", type=_COUNT, default=1, help="sequences per data-parallel rank (per TP group)")
    e.add_argument("--accum", type=_COUNT, default=1)
    e.add_argument("--seq", type=_COUNT, default=2048)
    e.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    e.add_argument("--activation-checkpointing", action="store_true")
    e.add_argument("--activation-offloading", action="store_true", help="implies checkpointing")
    e.add_argument(
        "--activation-loading-horizon", type=_COUNT, default=4, help="with offloading: checkpoints reloaded ahead"
    )
    e.add_argument("--eager-attention", action="store_true", help="attention keeps the s x s scores")
    e.add_argument(
        "--optimizer", default="adamw", choices=("adamw", "adam", "sgd-momentum", "sgd", "muon", "adafactor")
    )
    e.add_argument("--max-live-parameters", type=_at_least(1, kind=float), default=1e9)
    e.add_argument("--reduce-bucket-size", type=_at_least(1, kind=float), default=5e8)
    e.add_argument("--persistence-threshold", type=_at_least(0, kind=float), default=1e6)
    e.add_argument(
        "--shard-optimizer-state",
        action="store_true",
        help="the shard_optimizer_state knob: fp32 state split over the replicas too",
    )
    e.add_argument("--link-gbps", type=_at_least(0, kind=float), help="cross-node bytes and link time per step")
    e.add_argument("--ranks-per-node", type=_COUNT, help="with --link-gbps (default: the instance's GPUs)")
    e.add_argument("--node-secondary-shard", action="store_true", help="the sdp_node_secondary_shard knob")
    e.add_argument("--defer-cross-node-reduce", action="store_true", help="the sdp_defer_cross_node_reduce knob")
    e.add_argument("--quantize-cross-node", action="store_true", help="both sdp_quantize_cross_node_* knobs")
    e.add_argument("--lora-rank", type=_COUNT, help="a LoRA fine-tune: adapters of rank R, the base frozen")
    e.add_argument("--frozen-dtype", choices=("bf16", "int8", "nf4"), help="with --lora-rank (default bf16)")
    e.add_argument("--reference", action="store_true", help="check reference 003's configurations")
    e.set_defaults(func=estimate)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardpar", description="MiCS-style sharded data parallelism")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train a tiny GPT-NeoX on local CPU ranks (about two minutes)")
    d.add_argument("--nprocs", type=_COUNT, default=4)
    d.add_argument("--sdp", type=_COUNT, default=2)
    # the summary judges whether the loss fell from the first step to the last: that takes two
    d.add_argument("--steps", type=_at_least(2, why=": the demo checks that the loss falls"), default=500)
    d.add_argument("--batch", type=_COUNT, default=4, help="sequences per rank per step")
    d.add_argument("--seq", type=_COUNT, default=128)
    d.add_argument("--out", default="runs/demo", help="where metrics, plot, checkpoints and export go")
    d.set_defaults(func=demo)
    _estimate_parser(sub)
    e = sub.add_parser("env", help="versions, engines and a topology preview")
    e.add_argument("--world", type=int, default=8)
    e.add_argument("--tp", type=int, default=1)
    e.add_argument("--sdp", type=int, default=2)
    e.add_argument("--ranks-per-node", type=int, default=None)
    e.set_defaults(func=env)
    from shardpar.cli import convert

    convert.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as err:  # a mistake in the options: reported as argparse reports its own
        print(f"{parser.prog} {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
