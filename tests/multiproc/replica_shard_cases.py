"""Cases for test_replica_shard.py: shard_optimizer_state (issue 23, [Note: replica-sharded main] in
shardpar/runtime/replica_shard.py), run on every rank of a pool (importable for spawn).

Parity with single-process training is tests/multiproc/parity.py's (and tp_cases.py's under tensor
parallelism); checkpoints reuse checkpoint_cases.py's recipe (UnevenMLP, AdamW, clipping, a global
batch of 4 sliced by rdp rank), so any setting trains the same model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

import shardpar as smp
from shardpar.checkpoint.pieces import slots
from shardpar.cli import estimate
from tests import models
from tests.memory import LiveTensors, largest, total_bytes
from tests.multiproc import checkpoint_cases as ck
from tests.multiproc.parity import ADAM, _param_groups

ON = {"shard_optimizer_state": True}
NATIVE = {"ddp_dist_backend": "nccl"}  # gloo; the default ("auto") is the smddp engine


# ---- bf16 / fp16: the same training with the knob on and off ------------------------------------


def _stepped_state(model: Any, opt: Any) -> list[torch.Tensor]:
    """What a skipped step must leave alone: the stepped fp32 pieces, compute shards, persistent values
    and the optimizer state."""
    out = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    out += [u.compute_shard().clone() for u in model.units] + [model.persistent.compute.clone()]
    for state in opt.state.values():
        out += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _precision_run(precision: str, sdp: int, knobs: dict[str, Any], poison_step: int) -> dict[str, Any]:
    """4 steps of 2 micro-batches; at `poison_step` rank 3 passes an inf loss, so the step is skipped on
    every rank. No clipping: the clip coefficient comes from a norm summed in another order with the
    knob (over the rdp group's pieces), which may round differently (parity with clipping: fp32 cases)."""
    knobs = {**ck.SHARD, "sdp_gradient_clipping": 0.0, **knobs}
    smp.init({**knobs, "sharded_data_parallel_degree": sdp, precision: True})
    try:
        torch.manual_seed(0)
        model = smp.DistributedModel(models.UnevenMLP(), backward_passes_per_step=2)
        dynamic = {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2.0**10}}
        scaler = dynamic if precision == "fp16" else {}
        opt = smp.DistributedOptimizer(torch.optim.AdamW(_param_groups(model), **ADAM), **scaler)
        r, n = smp.rdp_rank(), smp.rdp_size()
        losses, skipped, scales, untouched = [], [], [], True
        for step in range(4):
            before = _stepped_state(model, opt) if step == poison_step else []
            total = 0.0
            for micro in range(2):
                batch = models.mlp_batch(100 * step + micro, 2 * n)
                batch["x"] = batch["x"].to(model.policy.compute)
                loss = model(**{k: v[2 * r : 2 * r + 2] for k, v in batch.items()})
                poison = step == poison_step and micro == 0 and smp.rank() == 3
                model.backward((loss * float("inf") if poison else loss) / 2)
                total += loss.item() / 2
            opt.step()
            opt.zero_grad()
            if before:
                after = _stepped_state(model, opt)
                untouched = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
            losses.append(sum(smp.allgather(total, smp.CommGroup.RDP_GROUP)) / n)
            skipped.append(opt.skipped)
            scales.append(opt.loss_scaler.loss_scale)
        return {
            "losses": losses,
            "skipped": skipped,
            "scales": scales,
            "untouched": untouched,
            "state": {k: v.float() for k, v in model.state_dict().items()},
            "split": [u.replica is not None for u in model.units if u.num_trainable],
        }
    finally:
        smp.shutdown()


def precision_case(precision: str, sdp: int = 2, knobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """World 4: knob off, then on."""
    knobs = knobs or {}
    return {
        "off": _precision_run(precision, sdp, knobs, poison_step=2),
        "on": _precision_run(precision, sdp, {**knobs, **ON}, poison_step=2),
    }


# ---- the communication schedule ---------------------------------------------------------------


def _summary(records: list[Any]) -> dict[tuple[str, str], dict[str, int]]:
    out: dict[tuple[str, str], dict[str, int]] = {}
    for rec in records:
        entry = out.setdefault((rec.op, rec.group), {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += rec.bytes
    return out


def schedule_case(sdp: int, knobs: dict[str, Any]) -> dict[str, Any]:
    """UnevenMLP, 2 micro-steps a window, a bucket per unit; the second window's records phase by
    phase: the first backward, the boundary backward, the optimizer step."""
    smp.init({**ck.SHARD, "sharded_data_parallel_degree": sdp, "sdp_reduce_bucket_size": 100, **knobs})
    try:
        torch.manual_seed(0)
        model = smp.DistributedModel(models.UnevenMLP(), backward_passes_per_step=2)
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), **ADAM))
        stats = model.engine.stats
        phases: dict[str, Any] = {}
        for step in range(2):
            stats.begin_step()
            for micro in range(2):
                batch = models.mlp_batch(10 * step + micro, 2)
                batch["x"] = batch["x"].to(model.policy.compute)
                model.backward(model(**batch) / 2)
                phases[f"backward {micro}"] = _summary(stats.begin_step())
            opt.step()  # closes the step in the records (DistributedModel.end_step)
            phases["step"] = _summary(stats.history[-1])
            opt.zero_grad()
        units = [(u.layout.shard_numel, u.num_trainable) for u in model.units]
        return {"phases": phases, "units": units, "replicas": smp.get_topology().replication.size}
    finally:
        smp.shutdown()


# ---- model-state memory, measured from live tensors ------------------------------------------


WIDTH, HIDDEN, DEPTH = 256, 384, 4
THRESHOLD = 1000  # biases and norms stay persistent; every weight matrix is sharded


def memory_case(precision: str, on: bool) -> dict[str, Any]:
    """Bytes of the storages a rank keeps after a step (grads still attached), against `shardpar
    estimate`'s model states for the same model and setting."""
    smp.init({"sdp_param_persistence_threshold": THRESHOLD, "sharded_data_parallel_degree": 2, **NATIVE,
              **({} if precision == "fp32" else {precision: True}), **(ON if on else {})})  # fmt: skip
    try:
        g = torch.Generator().manual_seed(smp.rdp_rank())
        x, y = torch.randn(4, WIDTH, generator=g), torch.randint(0, 5, (4,), generator=g)
        with torch.device("meta"):
            shape = estimate.shape_from_module(_mlp(), persistence_threshold=THRESHOLD)
        snapshot = LiveTensors()
        torch.manual_seed(0)
        model = smp.DistributedModel(_mlp())
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        for _ in range(2):
            opt.zero_grad()
            model.backward(model(x.to(model.policy.compute), y))
            opt.step()
        live = snapshot.since(exclude=[x, y])
        setup = estimate.Setup(
            sdp=2, precision=precision, device="cpu", shard_optimizer_state=on, world=smp.size(), optimizer="adamw"
        )
        return {
            "measured": total_bytes(live),
            "estimated": estimate.estimate(shape, setup).model_states,
            "largest": largest(live),
            "replicas": setup.replicas,
        }
    finally:
        smp.shutdown()


def _mlp() -> nn.Module:
    return models.UnevenMLP(width=WIDTH, hidden=HIDDEN, depth=DEPTH)


# ---- checkpoints ------------------------------------------------------------------------------


def save_midway_case(root: str, sdp: int, knobs: dict[str, Any]) -> dict[str, Any]:
    """3 steps, save, 3 more steps (the straight run) under `knobs`."""
    model, opt, sched = ck._build(sdp=sdp, **knobs)
    ck._train(model, opt, sched, range(3))
    at_save, moments = ck._full_state(model), ck._adam_moments(model, opt)
    out = ck._save(root, "step3", model, opt, user_content={"step": 3, "scheduler": sched.state_dict()})
    rest = ck._train(model, opt, sched, range(3, 6))
    result = {"losses": rest, "final": ck._full_state(model), "at_save": at_save, "moments": moments}
    result["files"] = sorted(p.name for p in out.iterdir()) if smp.rank() == 0 else []
    return result


def resume_case(root: str, sdp: int, knobs: dict[str, Any]) -> dict[str, Any]:
    """Build from another seed under `knobs`, resume the newest checkpoint, train steps 3..5."""
    model, opt, sched = ck._build(sdp=sdp, seed=123, **knobs)
    content = ck._resume(root, None, model, opt)
    sched.load_state_dict(content["scheduler"])
    resumed, moments = ck._full_state(model), ck._adam_moments(model, opt)
    losses = ck._train(model, opt, sched, range(3, 6))
    split = any(u.replica is not None for u in model.units)
    return {"losses": losses, "final": ck._full_state(model), "resumed": resumed, "moments": moments, "split": split}


def bf16_export_case(root: str) -> dict[str, Any]:
    """bf16, world 4, sdp 2 x 2 replicas: no rank holds a unit's fp32 values, yet the full export (and
    state_dict) gives exactly the fp32 main values, assembled here from every rank's pieces; a partial
    checkpoint resumes with the knob off into the same fp32 values and bf16 copies."""
    model, opt, sched = ck._build(sdp=2, bf16=True, **ON)
    ck._train(model, opt, sched, range(2))
    pieces = [(s.fqn, s.start, s.value.detach().clone(), s.param_shape) for s in slots(model) if s.length]
    assembled: dict[str, torch.Tensor] = {}
    for rank_pieces in smp.allgather(pieces):
        for fqn, start, values, shape in rank_pieces:
            flat = assembled.setdefault(fqn, torch.full(shape, float("nan")).reshape(-1))
            flat[start : start + values.numel()] = values.reshape(-1)
    state = ck._full_state(model)
    stats = model.engine.stats
    stats.begin_step()
    export = ck._save(root, "full", model, opt, partial=False)
    export_gathers = _summary(stats.begin_step())
    ck._save(root, "step2", model, opt)
    compute = max(  # the bf16 shards the replication AllGather refreshed: the cast of the fp32 pieces
        (u.compute_shard()[sl.local].float() - assembled[sl.spec.fqn][sl.param].bfloat16().float()).abs().max().item()
        for u in model.units
        for sl in u.slices
        if sl.length
    )
    out: dict[str, Any] = {"gathers": export_gathers, "split": [u.replica is not None for u in model.units]}
    out["compute_vs_pieces"] = compute
    if smp.rank() == 0:
        exported = load_file(str(Path(export) / "model.safetensors"))
        out["export_vs_pieces"] = max((exported[k].reshape(-1) - assembled[k]).abs().max().item() for k in assembled)
        out["state_vs_pieces"] = max((state[k].reshape(-1) - assembled[k]).abs().max().item() for k in assembled)
        out["export_keys"] = sorted(exported) == sorted(state) and all(
            exported[k].dtype == torch.float32 and exported[k].shape == state[k].shape for k in state
        )
    smp.shutdown()
    model, opt, sched = ck._build(sdp=2, bf16=True, seed=5)  # knob off
    ck._resume(root, "step2", model, opt)
    resumed = ck._full_state(model)
    out["resumed_vs_saved"] = max((resumed[k] - state[k]).abs().max().item() for k in state)
    return out


# ---- gradients kept across steps ----------------------------------------------------------------


def kept_grads_case(sdp: int) -> dict[str, float]:
    """SGD with momentum, 2 micro-steps a window; no zero_grad after step 0 (the next window adds to its
    gradient, as plain PyTorch allows) and zero_grad(set_to_none=False) after step 1: against a single
    process doing the same. With the knob the kept gradient is this rank's piece, and the next window's
    ReduceScatter adds to it."""
    smp.init({**ck.SHARD, "sharded_data_parallel_degree": sdp, "sdp_gradient_clipping": 0.0, **ON})
    try:
        torch.manual_seed(0)
        model = smp.DistributedModel(models.UnevenMLP(), backward_passes_per_step=2)
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        torch.manual_seed(0)
        ref = models.UnevenMLP()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        r, n = smp.rdp_rank(), smp.rdp_size()
        for step in range(4):
            for micro in range(2):
                batch = models.mlp_batch(100 * step + micro, 2 * n)
                model.backward(model(**{k: v[2 * r : 2 * r + 2] for k, v in batch.items()}) / 2)
                (ref(**batch) / 2).backward()
            opt.step()
            ref_opt.step()
            if step == 1:
                opt.zero_grad(set_to_none=False)
                ref_opt.zero_grad(set_to_none=False)
            elif step != 0:
                opt.zero_grad()
                ref_opt.zero_grad()
        split = all(u.replica is not None for u in model.units if u.num_trainable)
        return {"param": models.max_param_diff(model, ref), "split": float(split)}
    finally:
        smp.shutdown()


# ---- tensor parallelism: checkpoints --------------------------------------------------------------


def _tp_build(tp: int, sdp: int, seed: int, knobs: dict[str, Any]) -> tuple[Any, Any, Any]:
    from tests.multiproc import checkpoint_tp_cases as ckt

    smp.init({**ckt._knobs(tp, sdp), **knobs})
    model = smp.DistributedModel(ckt.BUILDERS["neox"](seed), tensor_parallelism=tp > 1)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(_param_groups(model), **ADAM))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def tp_save_case(root: str) -> dict[str, Any]:
    """World 4, tp 2 x sdp 1 x 2 replicas, knob on: 3 steps of tiny GPT-NeoX, a partial save, 3 more
    (checkpoint_tp_cases.py's recipe; values in the Hugging Face layout)."""
    from tests.multiproc import checkpoint_tp_cases as ckt

    try:
        model, opt, sched = _tp_build(2, 1, 0, ON)
        ckt._train("neox", model, opt, sched, range(ckt.SAVE_AT))
        at_save = ckt._stats_of(model, opt)
        out = ckt._save(root, "step3", model, opt, user_content={"step": ckt.SAVE_AT, "scheduler": sched.state_dict()})
        losses = ckt._train("neox", model, opt, sched, range(ckt.SAVE_AT, ckt.STEPS))
        result = {"at_save": at_save, "losses": losses, "final": ckt._stats_of(model, opt)}
        if smp.rank() == 0:
            index = json.loads((out / "index.json").read_text())
            result["stored"] = sum(
                torch.Size(shape).numel()
                for f in index["files"].values()
                for key, (_, shape) in f["tensors"].items()
                if key.startswith(("param/", "optim/"))
            )
            result["files"] = sorted(p.name for p in out.iterdir())
        return result
    finally:
        smp.shutdown()


def tp_resume_case(root: str, tp: int, sdp: int, knobs: dict[str, Any]) -> dict[str, Any]:
    from tests.multiproc import checkpoint_tp_cases as ckt

    try:
        model, opt, sched = _tp_build(tp, sdp, 123, knobs)
        content = ckt._resume(root, "step3", model, opt)
        sched.load_state_dict(content["scheduler"])
        resumed = ckt._stats_of(model, opt)
        losses = ckt._train("neox", model, opt, sched, range(ckt.SAVE_AT, ckt.STEPS))
        return {"resumed": resumed, "losses": losses, "final": ckt._stats_of(model, opt)}
    finally:
        smp.shutdown()
