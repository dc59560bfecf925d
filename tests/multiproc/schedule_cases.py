"""Cases for test_schedule.py: live cap, buckets, hierarchical gather, comm accounting, order changes."""

from __future__ import annotations

import warnings
from typing import Any

import torch

import shardpar as smp
from tests import models
from tests.multiproc.parity import ADAM

SHARD = {"sdp_param_persistence_threshold": 10}


def live_cap_case(cap_units: float) -> dict[str, Any]:
    """Train with sdp_max_live_parameters = cap_units x (root + one block); record every gather/free.
    The same run without a cap shows how far prefetch (depth 3) would go if the cap did not hold it."""
    probe = models.UnevenMLP()
    root_numel = sum(p.numel() for n, p in probe.named_parameters() if not n.startswith("blocks") and p.numel() >= 10)
    block_numel = sum(p.numel() for p in probe.blocks[0].parameters() if p.numel() >= 10)
    sdp = 2
    pad = lambda n: -(-n // sdp) * sdp  # noqa: E731
    one_block = pad(root_numel) + pad(block_numel)
    cap = int(cap_units * one_block)
    capped = _traced_run({**SHARD, "sharded_data_parallel_degree": sdp, "sdp_max_live_parameters": cap})
    uncapped = _traced_run({**SHARD, "sharded_data_parallel_degree": sdp, "sdp_max_live_parameters": 10**12})
    return {**capped, "cap": cap, "root_plus_one_block": one_block, "uncapped_max_live": uncapped["max_live"]}


def _traced_run(knobs: dict[str, Any], *, keep_trace: bool = False) -> dict[str, Any]:
    smp.init(knobs)
    try:
        torch.manual_seed(0)
        model = smp.DistributedModel(models.UnevenMLP())
        model.set_prefetch_depth(3)
        model.set_live_trace(True)
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), **ADAM))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                model.backward(model(**models.mlp_batch(step, 4)))
                opt.step()
                opt.zero_grad()
        trace = model.live.trace or []
        out = {
            "max_live": max(live for _, _, live in trace),
            "gathers": sum(1 for _, delta, _ in trace if delta > 0),
            "warnings": [str(w.message) for w in caught if "sdp_max_live_parameters" in str(w.message)],
            "final_live": model.live.live,
        }
        if keep_trace:
            engine = getattr(smp.get_engine(), "inner", None)
            out["trace"] = list(trace)
            out["units"] = {u.name: u.layout.padded_numel for u in model.units}
            out["hierarchical_units"] = [u.name for u in model.units if u.comm.node is not None]
            out["gather_routes"] = {k[1]: v for k, v in getattr(engine, "routes", {}).items() if k[0] == "all_gather"}
        return out
    finally:
        smp.shutdown()


def bucket_case(bucket: int) -> dict[str, Any]:
    smp.init({**SHARD, "sharded_data_parallel_degree": 2, "sdp_reduce_bucket_size": bucket})
    torch.manual_seed(0)
    model = smp.DistributedModel(models.UnevenMLP())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(2):
        model.backward(model(**models.mlp_batch(step, 4)))
        opt.step()
        opt.zero_grad()
    rs = [r for r in smp.comm_stats().history[-1] if r.op == "reduce_scatter"]
    return {
        "calls": len(rs),
        "bytes": sum(r.bytes for r in rs),
        "call_bytes": [r.bytes for r in rs],
        "async": all(r.async_op for r in rs),
        "units": {u.name: u.layout.padded_numel * 4 for u in model.units if u.num_trainable},
        "params": {k: v for k, v in model.state_dict().items()},
    }


def hierarchical_case() -> dict[str, Any]:
    """world 4 as 2 'nodes' x 2 ranks, sdp 4: hierarchical and flat gathers are bit-identical."""
    from shardpar.collectives.hierarchical import hierarchical_all_gather

    smp.init({**SHARD, "sharded_data_parallel_degree": 4, "ranks_per_node": 2})
    topo, eng = smp.get_topology(), smp.get_engine()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        shard = torch.randn(1001, generator=torch.Generator().manual_seed(smp.rank())).to(dtype)
        flat, hier = torch.empty(4004, dtype=dtype), torch.empty(4004, dtype=dtype)
        eng.all_gather(flat, shard, topo.sharding)
        hierarchical_all_gather(
            eng,
            hier,
            shard,
            sharding=topo.sharding,
            node=topo.groups["sharding_node"],
            cross=topo.groups["sharding_cross"],
        )
        out[str(dtype)] = bool(torch.equal(flat, hier))
    model = smp.DistributedModel(models.UnevenMLP())
    smp.comm_stats().begin_step()
    model(**models.mlp_batch(0, 4)).backward()
    groups = sorted({r.group for r in smp.comm_stats().current if r.op == "all_gather"})
    out["gather_groups"] = groups
    out["uses_hierarchy"] = model.units[0].comm.node is not None
    return out


def hierarchical_live_case() -> dict[str, Any]:
    """world 4 as 2 'nodes' x 2 ranks, sdp 4 (issue 18 item 3): every hierarchical gather's scratch
    (cross-node blocks + staging buffer) shows in the live trace, and the cap holds with it counted.
    Then sdp_hierarchical_allgather off (item 2): the units gather flat and the smddp engine routes
    those gathers natively, never hierarchically."""
    from shardpar.collectives.hierarchical import scratch_numel

    probe = models.UnevenMLP()
    root = sum(p.numel() for n, p in probe.named_parameters() if not n.startswith("blocks") and p.numel() >= 10)
    block = sum(p.numel() for p in probe.blocks[0].parameters() if p.numel() >= 10)
    pad = lambda n: -(-n // 4) * 4  # noqa: E731
    one_block = pad(root) + pad(block) + scratch_numel(pad(block), 2)  # root, and a block while it gathers
    cap = int(1.6 * one_block)
    hier = {**SHARD, "sharded_data_parallel_degree": 4, "ranks_per_node": 2}
    capped = _traced_run({**hier, "sdp_max_live_parameters": cap}, keep_trace=True)
    uncapped = _traced_run({**hier, "sdp_max_live_parameters": 10**12})
    off = _traced_run({**hier, "sdp_hierarchical_allgather": False}, keep_trace=True)
    return {
        "capped": capped,
        "uncapped_max_live": uncapped["max_live"],
        "off": off,
        "cap": cap,
        "one_block": one_block,
        "scratch": {n: scratch_numel(n, 2) for n in (pad(root), pad(block))},
    }


def comm_stats_case(world_replicas: int) -> dict[str, Any]:
    smp.init({**SHARD, "sharded_data_parallel_degree": 2, "sdp_reduce_bucket_size": 1})
    model = smp.DistributedModel(models.tiny_neox())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), **ADAM))
    for step in range(2):
        model.backward(model(**models.lm_batch(step, 2)).loss)
        opt.step()
        opt.zero_grad()
    units = [(u.name, u.layout.padded_numel, u.layout.shard_numel, u.num_trainable) for u in model.units]
    num_params = sum(len(u.params) for u in model.units) + len(model.persistent.params)
    return {
        "stats": model.comm_stats(),
        "units": units,
        "persistent": model.persistent.main.numel(),
        "num_params": num_params,
        "replicas": smp.get_topology().replication.size,
    }


def order_change_case() -> dict[str, float]:
    """Steps alternate block orders (skip, reverse) and interleave eval: parity with single process."""
    smp.init({**SHARD, "sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0.0})
    torch.manual_seed(0)
    model = smp.DistributedModel(models.BranchyMLP())
    model.set_prefetch_depth(2)
    torch.manual_seed(0)
    ref = models.BranchyMLP()
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    rank, world = smp.rank(), smp.size()
    loss_diff = 0.0
    for step, mode in enumerate([0, 1, 2, 0, 2, 1, 0]):
        batch = models.mlp_batch(step, 4 * world)
        local = {k: v[4 * rank : 4 * rank + 4] for k, v in batch.items()}
        loss = model(**local, mode=mode)
        model.backward(loss)
        opt.step()
        opt.zero_grad()
        ref_loss = ref(**batch, mode=mode)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():  # an eval pass in yet another order between steps
            model.eval()
            model(**local, mode=(mode + 1) % 3)
            model.train()
        loss_diff = max(loss_diff, abs(sum(smp.allgather(loss.item())) / world - ref_loss.item()))
    return {
        "loss": loss_diff,
        "param": models.max_param_diff(model, ref),
        "live_after": float(model.live.live),
    }


def replication_overlap_case(knobs: dict[str, Any], accumulate: bool) -> dict[str, Any]:
    """sdp 1 (plain data parallelism), one unit per bucket: the replication AllReduce of each bucket
    is issued during backward ([Note: replication in the bucket]). Trains twice, side by side: as
    shipped, and with the bucket AllReduce turned off (the per-unit AllReduce after backward), so
    the two can be compared bit for bit. `accumulate`: two micro-batches (smp.step, scale 1/2) times
    two backward passes per step, so the fold sees an earlier main grad and a scale; else one."""
    runs, micro = {}, 2 if accumulate else 1
    for overlap in (True, False):
        smp.init(
            {**SHARD, **knobs, "sharded_data_parallel_degree": 1, "sdp_reduce_bucket_size": 1, "microbatches": micro}
        )
        try:
            dtype = torch.bfloat16 if knobs.get("bf16") else torch.float16 if knobs.get("fp16") else torch.float32
            runs[overlap] = _overlap_run(overlap, dtype, micro)
        finally:
            smp.shutdown()
    same = {k: torch.equal(v, runs[False]["params"][k]) for k, v in runs[True]["params"].items()}
    return {
        "bit_identical": all(same.values()),
        "differs": [k for k, ok in same.items() if not ok],
        "pending_at_allreduce": runs[True]["pending"],
        "pending_without": runs[False]["pending"],
        "trainable_units": runs[True]["trainable_units"],
    }


def _overlap_run(overlap: bool, dtype: torch.dtype, micro: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = smp.DistributedModel(models.UnevenMLP(), backward_passes_per_step=micro)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), **ADAM))
    engine, replication = smp.get_engine(), smp.get_topology().replication
    pending: list[int] = []  # per replication AllReduce: trainable units whose grads had not arrived yet
    issue = engine.all_reduce

    def recording_all_reduce(tensor: torch.Tensor, group: Any, **kw: Any) -> Any:
        if group == replication:
            pending.append(sum(1 for u in model.units if u.num_trainable and not u.reduced))
        return issue(tensor, group, **kw)

    engine.all_reduce = recording_all_reduce  # type: ignore[method-assign]
    if not overlap:
        begin = model.reducer.begin_backward
        model.reducer.begin_backward = lambda *, boundary, scale: begin(boundary=False, scale=scale)  # type: ignore[method-assign]

    @smp.step
    def train_step(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = model(**batch)
        model.backward(loss / micro)
        return loss

    for step in range(3):
        pending.clear()
        for index in range(micro):
            batch = models.mlp_batch(10 * step + index + smp.rank() * 100, 8)
            train_step(model, {**batch, "x": batch["x"].to(dtype)})
        opt.step()
        opt.zero_grad()
    engine.all_reduce = issue  # type: ignore[method-assign]
    return {
        "params": {k: v.clone() for k, v in model.state_dict().items()},
        "pending": list(pending),
        "trainable_units": sum(1 for u in model.units if u.num_trainable),
    }


def rank_dependent_branch_case(layouts: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
    """On rank 1 blocks.1 gets no gradient (BranchyMLP `mode`: 1 skips the block, 3 runs it detached),
    so that unit is packed (as zeros) at the end of backward on rank 1 but mid-backward on rank 0
    ([Note: bucket plan]). Per (sdp, bucket size, mode): max abs diff against one process running
    every rank's micro-batch (plain SGD: the check is about which gradients get averaged together)."""
    return [_branch_run(sdp, bucket, mode) for sdp, bucket, mode in layouts]


def zero_spans_case(layouts: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """sdp 2: block 1 gets no gradient on any rank (BranchyMLP mode 3 everywhere) and blocks.0.up.weight
    is frozen, so some units reduce zeros for whole parameters, besides their padding. Per (engine,
    bucket size): max abs diff against one process, and whether the grads were read in place
    ([Note: gradients read in place])."""
    out = []
    for engine, bucket in layouts:
        r = _branch_run(2, bucket, 3, everywhere=True, engine=engine, freeze="blocks.0.up.weight")
        out.append({**r, "engine": engine})
    return out


def _branch_run(
    sdp: int, bucket: int, mode: int, *, everywhere: bool = False, engine: str = "auto", freeze: str = ""
) -> dict[str, Any]:
    knobs = {
        "sharded_data_parallel_degree": sdp,
        "sdp_reduce_bucket_size": bucket,
        "sdp_gradient_clipping": 0.0,
        "ddp_dist_backend": engine,
    }
    smp.init({**SHARD, **knobs})
    try:

        def build() -> torch.nn.Module:
            module = models.BranchyMLP()
            if freeze:
                module.get_parameter(freeze).requires_grad_(False)
            return module

        model, opt, ref, ref_opt = models.sgd_twins(build)
        rank, world = smp.rank(), smp.size()
        modes = [mode if r == 1 or everywhere else 0 for r in range(world)]
        for step in range(3):
            batches = [models.mlp_batch(100 * step + r, 4) for r in range(world)]
            model.backward(model(**batches[rank], mode=modes[rank]))
            opt.step()
            opt.zero_grad()
            (sum(ref(**b, mode=m) for b, m in zip(batches, modes, strict=True)) / world).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        return {
            "sdp": sdp,
            "bucket": bucket,
            "mode": mode,
            "param": models.max_param_diff(model, ref),
            "buckets": len(model.reducer.plans),
            "in_place": model.reducer.reads_in_place,
        }
    finally:
        smp.shutdown()
