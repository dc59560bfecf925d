"""Convergence with cross-node compression (issue 28, item 3): the demo's model and recipe, 300 steps on
4 local ranks as two "nodes" of 2 (ranks_per_node=2, sdp 4 spanning both), once in fp32 on the wire and
once with int8 weights on the cross-node gather and int8 gradients with error feedback on the
cross-node ReduceScatter. Passes when the compressed run's final loss (mean of the last 20 steps) is
within 1 % of the exact run's.

    python benchmarks/check_compression.py [--steps 300] [--out /tmp/compression]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SPAN = {
    "sdp_param_persistence_threshold": 1000,
    "ranks_per_node": 2,
    "sdp_defer_cross_node_reduce": True,
    "sdp_node_secondary_shard": True,
}
QUANTIZED = {"sdp_quantize_cross_node_weights": True, "sdp_quantize_cross_node_gradients": True}


def main() -> int:
    from shardpar.cli.demo import demo_options, demo_rank
    from shardpar.cli.launcher import launch_local

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="shardpar-compression-"))
    finals: dict[str, float] = {}
    for name, knobs in (("exact", SPAN), ("int8", {**SPAN, **QUANTIZED})):
        opts = demo_options(sdp=4, steps=args.steps, batch=4, seq=128, out=str(out / name))
        opts = replace(opts, smp={**opts.smp, **knobs}, checkpoint_every=args.steps)
        result = launch_local(demo_rank, 4, opts)[0]
        finals[name] = statistics.fmean(result.losses[-20:])
        print(f"{name:6s} final loss (mean of the last 20 steps) {finals[name]:.4f}", flush=True)
    rel = abs(finals["int8"] - finals["exact"]) / finals["exact"]
    verdict = "within" if rel <= 0.01 else "NOT within"
    print(f"int8 vs exact: {rel * 100:.2f} % -- {verdict} 1 %")
    (out / "compression.json").write_text(json.dumps({**finals, "relative": rel, "steps": args.steps}))
    return 0 if rel <= 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
