"""`shardpar convert SRC DST --to {shardpar,dcp,hf}`: checkpoints between shardpar's format, a
torch.distributed.checkpoint directory and a Hugging Face directory, offline in one process
(shardpar/checkpoint/convert.py says what each format holds)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    c = sub.add_parser(
        "convert",
        help="convert a checkpoint between shardpar, torch.distributed.checkpoint (DCP) and Hugging Face",
        description="Offline, one process; never runs pickled code. The source format is detected.",
    )
    c.add_argument("src", help="a shardpar checkpoint root (or its <tag>_partial), a DCP directory or an HF directory")
    c.add_argument("dst", help="where to write (a shardpar root, a DCP directory or an HF directory)")
    c.add_argument("--to", required=True, choices=("shardpar", "dcp", "hf"))
    c.add_argument("--tag", default="converted", help="--to shardpar: the checkpoint's tag (default converted)")
    c.add_argument(
        "--optimizer-class",
        help="--to shardpar from DCP: the torch.optim class of the saved optimizer state (e.g. AdamW)",
    )
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shardpar.checkpoint import convert

    src, dst = Path(args.src), Path(args.dst)
    if not src.is_dir():
        raise ValueError(f"source {src} is not a directory")
    if args.to != "shardpar" and dst.exists() and any(dst.iterdir()):
        raise ValueError(f"destination {dst} exists and is not empty: pick a new directory (convert never overwrites)")
    kind = convert.detect(src)
    state = convert.read(src)
    if args.optimizer_class:
        if state.optimizer_class and state.optimizer_class != args.optimizer_class:
            raise ValueError(
                f"--optimizer-class {args.optimizer_class}: {src} records {state.optimizer_class}; drop the option"
            )
        state.optimizer_class = args.optimizer_class
    if args.to == "shardpar":
        if (dst / f"{args.tag}_partial").exists():
            raise ValueError(f"{dst}/{args.tag}_partial exists: pick another --tag or destination")
        out = convert.write_shardpar(state, dst, args.tag)
    elif args.to == "dcp":
        out = convert.write_dcp(state, dst)
    else:
        out = convert.write_hf(state, dst)
    what = f"{len(state.model)} model tensors"
    if state.optim is not None:
        what += " (optimizer state dropped: HF holds weights only)" if args.to == "hf" else " and optimizer state"
    print(f"converted {kind} {src} -> {args.to} {out}: {what}")
    return 0
