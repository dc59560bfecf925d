"""`shardpar estimate`'s recommendations: the smallest sharding degree that fits, the variants to try
when none does, and reference 003's rule that tensor parallelism lowers the global batch. Each
candidate is priced by `estimate.estimate`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from shardpar.cli.estimate import Estimate, ModelShape, Setup, estimate


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def smallest_fitting_sdp(shape: ModelShape, setup: Setup, world: int) -> Estimate | None:
    """The fitting estimate with the smallest sdp dividing world / tp (reference 003: start small)."""
    if world % setup.tp:
        raise ValueError(f"tensor_parallel_degree={setup.tp} must divide the world size {world}")
    for sdp in divisors(world // setup.tp):
        est = estimate(shape, replace(setup, sdp=sdp, world=world))
        if est.fits:
            return est
    return None


def alternatives(shape: ModelShape, setup: Setup, world: int, tps: Iterable[int] = (1, 2, 4, 8)) -> list[Estimate]:
    """When nothing fits: the smallest fitting sdp per (tp, checkpointing, offloading) variant."""
    found: list[Estimate] = []
    for tp in tps:
        if world % tp:
            continue
        for ckpt, offload in (
            (setup.activation_checkpointing, setup.activation_offloading),
            (True, False),
            (True, True),
        ):
            variant = replace(setup, tp=tp, sdp=1, activation_checkpointing=ckpt, activation_offloading=offload)
            est = smallest_fitting_sdp(shape, variant, world)
            if est is not None and all(e.setup != est.setup for e in found):
                found.append(est)
                break
    return found


def tp_from_global_batch(world: int, global_batch: int, batch: int, accum: int = 1) -> int:
    """Reference 003: tensor parallelism lowers the global batch; tp = world / (global / (batch x accum))."""
    if global_batch % (batch * accum):
        raise ValueError(f"global batch {global_batch} is not a multiple of batch {batch} x accumulation {accum}")
    rdp = global_batch // (batch * accum)
    if rdp == 0 or world % rdp:
        raise ValueError(
            f"global batch {global_batch} / (batch {batch} x accumulation {accum}) = {rdp} data-parallel "
            f"ranks must divide the world size {world}"
        )
    return world // rdp
