"""What `smp.DistributedModel` did, said once: one INFO record on rank 0 (logger "shardpar") naming the
layout, the engine, the units, which parameters are sharded and which the persistence threshold keeps
whole, the model-state bytes a rank holds, and the clipping in force; and a WARNING when nothing is
sharded (issue 29 item 5). Through `logging`, not `warnings`: AWS's own training template runs
`warnings.simplefilter("ignore")`, which would hide it. Like SageMaker v1's config display, it is
an INFO record: a script shows it with `logging.basicConfig(level=logging.INFO)`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardpar.config import Config
from shardpar.optim.optimizer import DistributedOptimizer
from shardpar.runtime.model import DistributedModel

_LOG = logging.getLogger("shardpar")
_MIB = 1024 * 1024
# What a rank adds per element it steps, beyond the parameters: an fp32 main gradient and an Adam-style
# optimizer's two fp32 moments (exp_avg, exp_avg_sq).
_GRAD_AND_ADAM_BYTES = 4 + 8


def clipping_in_force(config: Config) -> str:
    """The gradient clipping that applies at wrap time, as the summary names it: the SMP API's
    `sdp_gradient_clipping` in `optimizer.step()`. A front end that takes clipping over (the Trainer's
    max_grad_norm, accelerate's clip_grad_norm_) logs the change when it does
    (`DistributedOptimizer.set_clipping`, [Note: clipping belongs to the user's front end])."""
    max_norm = config.sdp_gradient_clipping
    if max_norm <= 0:
        return "off (sdp_gradient_clipping=0)"
    return (
        f"built-in, global L2 max norm {max_norm:g} in optimizer.step() (sdp_gradient_clipping; a "
        "clip_grad_norm_ in the window replaces it for that step)"
    )


@dataclass(frozen=True)
class WrapSummary:
    world: int
    sdp: int
    replicas: int
    tp: int
    engine: str
    units: int
    unit_names: tuple[str, ...]
    sharded_tensors: int
    sharded_elements: int  # this TP rank's, before sharding
    whole_tensors: int
    whole_elements: int
    largest_whole: int
    threshold: int
    param_bytes: int  # parameter storages this rank holds now: fp32 main shards, compute copies, persistent
    state_bytes: int  # param_bytes plus fp32 gradients and two Adam moments of what this rank steps
    precision: str
    clipping: str

    @property
    def nothing_sharded(self) -> bool:
        return self.sdp > 1 and self.sharded_tensors == 0 and self.whole_tensors > 0

    def text(self) -> str:
        per_tp = " (this TP rank's)" if self.tp > 1 else ""
        return "\n".join(
            [
                f"shardpar is active: smp.DistributedModel over {self.world} rank(s)",
                f"  layout: sdp {self.sdp} x replicas {self.replicas} x tp {self.tp}; engine {self.engine}",
                f"  units: {self.units} ({', '.join(self.unit_names[:4])}{', ...' if self.units > 4 else ''})",
                f"  parameters{per_tp}: {self.sharded_tensors} tensors ({self.sharded_elements:,} elements) sharded "
                f"over sdp {self.sdp}; {self.whole_tensors} ({self.whole_elements:,} elements) kept whole on every "
                f"rank, each under sdp_param_persistence_threshold={self.threshold:,} elements",
                f"  model states per rank: {self.param_bytes / _MIB:.2f} MiB of parameters now; about "
                f"{self.state_bytes / _MIB:.2f} MiB with fp32 gradients and Adam's two moments",
                f"  precision: {self.precision}",
                f"  clipping: {self.clipping}",
            ]
        )

    def warning(self) -> str:
        return (
            f"shardpar: nothing is sharded: all {self.whole_tensors} parameters ({self.whole_elements:,} elements, "
            f"the largest {self.largest_whole:,}) have fewer than sdp_param_persistence_threshold="
            f"{self.threshold:,} elements, so every rank keeps the whole model and sdp {self.sdp} saves no memory; "
            "set sdp_param_persistence_threshold lower (0 shards every parameter)"
        )


def summarize(model: DistributedModel, engine_name: str) -> WrapSummary:
    cfg, topo, persistent = model.shardpar_config, model.topology, model.persistent
    held: dict[int, int] = {}  # storage -> bytes, each storage once (in fp32 a compute copy is the main)
    tensors: list[torch.Tensor | None] = [persistent.main, persistent.compute]
    for u in model.units:
        tensors += [u.main_shard, u._compute_shard, *u.replicas.own_tensors()]
        if u.frozen is not None:  # frozen at wrap time: its shard in its dtype (+ compute copy or codes)
            tensors += [u.frozen.shard, u.frozen._compute, u.frozen._packed]
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    stepped = sum(piece.length for piece in model.sharded_state.pieces if not piece.frozen)  # no grad, no Adam
    compute = "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else "fp32"
    layouts = [u.layout for u in model.units] + [u.frozen.layout for u in model.units if u.frozen is not None]
    return WrapSummary(
        world=topo.plan.world,
        sdp=topo.sharding.size,
        replicas=topo.replication.size,
        tp=topo.tp.size,
        engine=engine_name,
        units=len(model.units),
        unit_names=tuple(u.name for u in model.units),
        sharded_tensors=sum(len(layout.specs) for layout in layouts),
        sharded_elements=sum(s.numel for layout in layouts for s in layout.specs),
        whole_tensors=len(persistent.params),
        whole_elements=int(persistent.main.numel()),
        largest_whole=max((p.numel() for p in persistent.params), default=0),
        threshold=cfg.sdp_param_persistence_threshold,
        param_bytes=sum(held.values()),
        state_bytes=sum(held.values()) + _GRAD_AND_ADAM_BYTES * stepped,
        precision=f"{compute} compute, fp32 main shards, {cfg.sdp_reduce_dtype} gradient reductions",
        clipping=clipping_in_force(cfg),
    )


def log_wrap_summary(model: DistributedModel, engine_name: str) -> WrapSummary:
    """One INFO record (and the nothing-sharded WARNING) on rank 0; returns the summary on every rank."""
    summary = summarize(model, engine_name)
    if model.topology.rank == 0:
        _LOG.info(summary.text())
        if summary.nothing_sharded:
            _LOG.warning(summary.warning())
    return summary


def owner_compute_lines(optimizer: DistributedOptimizer) -> list[str]:
    """The wrap summary's part for an optimizer that is not element-wise: which ranks step which whole
    parameters ([Note: owner compute], optim/owner_compute.py), balanced by work and bytes."""
    lines = []
    for oc in optimizer.owners:
        mine = ", ".join(o.fqn for o in oc.plan.of(oc.me)[:4]) + (", ..." if len(oc.plan.of(oc.me)) > 4 else "")
        lines.append(
            f"{oc.plan.text()}; all_to_all {oc.bytes_per_step() / _MIB:.2f} MiB per step and rank; "
            f"rank 0 owns {len(oc.plan.of(oc.me))}: {mine or 'none'}"
        )
    return lines


def log_owner_compute(optimizer: DistributedOptimizer) -> None:
    """INFO on rank 0 when smp.DistributedOptimizer wraps an optimizer that is not element-wise."""
    if optimizer.model.topology.rank == 0:
        for line in owner_compute_lines(optimizer):
            _LOG.info(line)


def engine_name(name: str, backend_knob: str) -> str:
    """E.g. "smddp (ddp_dist_backend='auto'; torch.distributed backend gloo)"."""
    backend = dist.get_backend() if dist.is_initialized() else "none"
    return f"{name} (ddp_dist_backend={backend_knob!r}; torch.distributed backend {backend})"
