"""`shardpar estimate --optimizer muon|adafactor`: what owner compute ([Note: owner compute],
optim/owner_compute.py) costs a rank, from the model's dimensions.

The matrices of a decoder block are laid out the standard way (q/k/v [3h, h], the output projection
[h, h], the MLP [4h, h] and [h, 4h]; TP-local shapes cut the first dim by tp, the owner steps them
TP-merged) and handed to the same planner the optimizer runs (optim/ownership.py), over the exchange
group (sdp ranks, x replicas with shard_optimizer_state). Muon's recipe steps the block matrices
with Muon and the embeddings, head, norms and biases with AdamW (element-wise pieces, as today);
Adafactor steps every sharded parameter whole.

Per rank it prints the owner bytes (the owner's fp32 copy of what it owns plus the optimizer state
for it) against the even share, the Newton-Schulz work against the even share, and the all_to_all
bytes a step adds (2 x n x the largest block, as the optimizer pads them).
"""

from __future__ import annotations

import math
from typing import Any

from shardpar.optim.ownership import OwnerPlan, plan_owners

OWNER_KINDS = ("muon", "adafactor")


def block_matrices(shape: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(name, full shape) of each decoder block's weight matrices."""
    h = shape.hidden
    out: list[tuple[str, tuple[int, ...]]] = []
    for layer in range(shape.num_layers):
        dims: tuple[int, ...]
        for name, dims in (("qkv", (3 * h, h)), ("proj", (h, h)), ("fc1", (4 * h, h)), ("fc2", (h, 4 * h))):
            out.append((f"layers.{layer}.{name}", dims))
    return out


def plan_for(shape: Any, setup: Any) -> OwnerPlan:
    members = setup.sdp * setup.split
    matrices = block_matrices(shape)
    if setup.optimizer == "adafactor":
        matrices.append(("embed", (shape.vocab, shape.hidden)))
    return plan_owners(matrices, setup.optimizer, members)


def a2a_bytes_per_rank(plan: OwnerPlan, tp: int) -> int:
    """Both all_to_alls of a step on one rank (fp32): n blocks each, a block ~ the largest owner's
    TP-local elements over n (each member holds ~1/n of every parameter)."""
    n = plan.members
    if n == 1:
        return 0
    owned = [sum(math.prod(o.shape) for o in plan.of(m)) for m in range(n)]
    return int(2 * n * (max(owned) / tp / n) * 4)


def format_owner_plan(shape: Any, setup: Any) -> str:
    plan = plan_for(shape, setup)
    mib = 2**20
    per = plan.load("bytes")
    even = sum(per) / plan.members
    lines = [
        f"  owner compute ({setup.optimizer}): {len(plan.owned)} matrices stepped whole over {plan.members} ranks "
        f"(sdp {setup.sdp}{' x replicas' if setup.split > 1 else ''})",
        f"      owner bytes per rank (fp32 copy + state): max {max(per) / mib:,.1f} MiB, even share "
        f"{even / mib:,.1f} MiB (x{plan.imbalance('bytes'):.2f}); work x{plan.imbalance('work'):.2f} of even",
        f"      all_to_all per step and rank: ~{a2a_bytes_per_rank(plan, setup.tp) / mib:,.1f} MiB",
    ]
    return "\n".join(lines)
