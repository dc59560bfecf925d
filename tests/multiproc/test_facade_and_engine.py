"""smp facade + NativeEngine + counting on real gloo ranks (several cases per spawn)."""

from __future__ import annotations

import os

import pytest
import torch

import shardpar as smp
from shardpar.collectives import ReduceOp, shm
from shardpar.topology import plan


def _facade_queries(knobs: dict) -> dict:
    smp.init(knobs)
    topo = smp.get_topology()
    out = {
        "rank": smp.rank(),
        "size": smp.size(),
        "tp": (smp.tp_rank(), smp.tp_size()),
        "rdp": (smp.rdp_rank(), smp.rdp_size()),
        "sdp": (smp.sdp_rank(), smp.sdp_size()),
        "dp": (smp.dp_rank(), smp.dp_size()),
        "local": (smp.local_rank(), smp.local_size()),
        "groups": {k: g.ranks for k, g in topo.groups.items()},
        "gathered": smp.allgather(smp.rank() * 10, smp.CommGroup.SDP_GROUP),
        # the collective form names its source; without src it is SMP v1's sender-only broadcast (api/p2p.py)
        "bcast": smp.broadcast(
            f"from {smp.rank()}", smp.CommGroup.TP_GROUP, src=smp.get_topology().group("tp").ranks[0]
        ),
    }
    try:  # global rank 3 is in the sharding group of ranks 2 and 3 only: the others raise, nobody waits
        out["bcast_src3"] = smp.broadcast(f"from {smp.rank()}", smp.CommGroup.SDP_GROUP, src=3)
    except ValueError as e:
        out["bcast_src3"] = str(e)
    smp.barrier(smp.CommGroup.REPLICATION_GROUP)
    return out


@pytest.mark.parametrize(
    ("world", "knobs"),
    [
        (4, {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "prescaled_batch": True}),
        (4, {"sharded_data_parallel_degree": 2, "ranks_per_node": 2}),
    ],
)
def test_facade_matches_plan(ranks, world: int, knobs: dict) -> None:
    results = ranks.run(world, _facade_queries, knobs)
    p = plan(
        world,
        knobs.get("tensor_parallel_degree", 1),
        knobs["sharded_data_parallel_degree"],
        knobs.get("ranks_per_node", world),
    )
    for r, res in enumerate(results):
        c = p.coords(r)
        assert res["rank"] == r and res["size"] == world and res["dp"] == (r, world)
        assert res["tp"] == (c.tp_rank, p.tp) and res["rdp"] == (c.rdp_rank, p.rdp)
        assert res["sdp"] == (c.sdp_rank, p.sdp) and res["local"] == (r, world)
        assert res["groups"] == p.groups_of(r)
        assert res["gathered"] == [x * 10 for x in p.groups_of(r)["sharding"]]
        assert res["bcast"] == f"from {p.groups_of(r)['tp'][0]}"
        sharding = p.groups_of(r)["sharding"]
        expected = (
            "from 3"
            if 3 in sharding
            else f"broadcast src=3 is not in this rank's SDP_GROUP (global ranks {list(sharding)})"
        )
        assert res["bcast_src3"].startswith(expected), res["bcast_src3"]


def _engine_collectives() -> dict:
    smp.init({"sharded_data_parallel_degree": 2})  # world 4: 2 sharding groups x 2 replicas
    eng, topo, rank = smp.get_engine(), smp.get_topology(), smp.rank()
    stats = smp.comm_stats()
    stats.begin_step()
    shard, repl = topo.sharding, topo.replication
    out: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        k = 1001  # odd size
        mine = torch.arange(k, dtype=torch.float32).add_(rank * 1000).to(dtype)
        gathered = torch.empty(2 * k, dtype=dtype)
        eng.all_gather(gathered, mine, shard)
        out[f"ag_{dtype}"] = gathered
        full = torch.full((2 * k,), float(rank + 1), dtype=dtype)
        part = torch.empty(k, dtype=dtype)
        eng.reduce_scatter(part, full, shard, op=ReduceOp.AVG)
        out[f"rs_avg_{dtype}"] = part
    t = torch.ones(5) * rank
    work = eng.all_reduce(t, repl, async_op=True)
    work.wait()
    out["ar_sum"] = t
    b = torch.full((3,), float(rank))
    eng.broadcast(b, src=shard.ranks[1], group=shard)
    out["bcast"] = b
    empty = torch.empty(0)
    eng.all_gather(torch.empty(0), empty, shard)
    out["records"] = [(r.op, r.group, r.bytes, r.async_op) for r in stats.begin_step()]
    out["shard"], out["repl"] = shard.ranks, repl.ranks
    return out


def test_native_engine_collectives_and_counting(ranks) -> None:
    results = ranks.run(4, _engine_collectives)
    for rank, res in enumerate(results):
        shard = res["shard"]
        for dtype in (torch.float32, torch.bfloat16):
            expect = torch.cat([torch.arange(1001, dtype=torch.float32).add_(r * 1000).to(dtype) for r in shard])
            assert torch.equal(res[f"ag_{dtype}"], expect), "gather is bit-exact"
            mean = sum(r + 1 for r in shard) / 2
            assert torch.equal(res[f"rs_avg_{dtype}"], torch.full((1001,), mean, dtype=dtype))
        assert torch.equal(res["ar_sum"], torch.ones(5) * sum(res["repl"]))
        assert torch.equal(res["bcast"], torch.full((3,), float(shard[1])))
        assert res["records"] == [
            ("all_gather", "sharding", 2002 * 4, False),
            ("reduce_scatter", "sharding", 2002 * 4, False),
            ("all_gather", "sharding", 2002 * 2, False),
            ("reduce_scatter", "sharding", 2002 * 2, False),
            ("all_reduce", "replication", 5 * 4, True),
            ("broadcast", "sharding", 3 * 4, False),
            ("all_gather", "sharding", 0, False),
        ], f"rank {rank}"


def _bad_shapes() -> str:
    smp.init({"sharded_data_parallel_degree": 2})
    eng, shard = smp.get_engine(), smp.get_topology().sharding
    try:
        eng.all_gather(torch.empty(5), torch.empty(3), shard)
    except ValueError as e:
        return str(e)
    return "no error"


def test_shape_errors_are_clear_and_raised_before_communicating(ranks) -> None:
    msgs = ranks.run(2, _bad_shapes)
    assert all("all_gather: the large tensor has 5 elements but must have group size 2 x 3 = 6" in m for m in msgs)


def _config_error_before_groups() -> str:
    import torch.distributed as dist

    groups_before = dist.distributed_c10d._world.group_count
    try:
        smp.init({"sharded_data_parallel_degree": 3})
    except ValueError as e:
        assert dist.distributed_c10d._world.group_count == groups_before, "no group created"
        return str(e)
    return "no error"


def test_world_errors_before_any_group(ranks) -> None:
    msgs = ranks.run(4, _config_error_before_groups)
    assert all("sharded_data_parallel_degree=3 must divide the reduced data-parallel degree 4" in m for m in msgs)


def _configs_that_differ_between_ranks() -> str:
    # Rank 1 asks for another sdp degree and another ranks_per_node: its groups would differ, and the
    # ranks would call new_group in different orders.
    rank = int(os.environ["RANK"])
    knobs = {"sharded_data_parallel_degree": 2 if rank == 0 else 1, "ranks_per_node": 2 if rank == 0 else 1}
    try:
        smp.init(knobs)
    except ValueError as e:
        return str(e)
    return "no error"


def test_configs_that_differ_between_ranks_are_refused_on_every_rank(ranks) -> None:
    for msg in ranks.run(2, _configs_that_differ_between_ranks, timeout=60):
        assert msg.startswith("smp.init: every rank must use the same config: "), msg
        assert "sharded_data_parallel_degree is 2 on rank 0 but 1 on rank 1" in msg
        assert "ranks_per_node (or LOCAL_WORLD_SIZE) is 2 on rank 0 but 1 on rank 1" in msg


def _dead_peer_times_out() -> str:
    smp.init({"sharded_data_parallel_degree": 2, "collective_timeout_s": 2.0})
    if smp.rank() == 1:
        return "skipped the collective"  # rank 1 never joins: rank 0 must not hang
    t = torch.ones(4)
    try:
        smp.get_engine().all_reduce(t, smp.get_topology().sharding)
    except Exception as e:  # gloo raises RuntimeError on timeout
        return f"error: {type(e).__name__}"
    return "no error"


def test_missing_peer_is_an_error_not_a_hang(ranks) -> None:
    results = ranks.run(2, _dead_peer_times_out, timeout=60, discard=True)
    assert results[0].startswith("error"), results


def _replica_peer_missing() -> str:
    """World 4, sdp 2: the replication group of rank 1 is {1, 3} (local indexes 0, 1)."""
    smp.init({"sharded_data_parallel_degree": 2, "collective_timeout_s": 2.0, "ddp_dist_backend": "smddp"})
    if smp.rank() != 1:
        return "not waiting"  # rank 3 never joins
    try:
        smp.get_engine().all_reduce(torch.ones(4), smp.get_topology().replication)
    except Exception as e:
        return str(e)
    return "no error"


@pytest.mark.skipif(not shm.available()[0], reason="needs the shm transport")
def test_missing_peer_error_names_its_global_rank(ranks) -> None:
    message = ranks.run(4, _replica_peer_missing, timeout=60, discard=True)[1]
    assert "global rank 3 (local index 1)" in message and "did not arrive within 2 s" in message, message


@pytest.mark.parametrize(
    ("local_world_size", "pattern"),
    [("3", r"ranks_per_node=3 .* must divide the world size 4; use one of \[1, 2, 4\]"), ("x", r"must be integers")],
)
def test_bad_launcher_env_is_an_error_before_any_group(monkeypatch, local_world_size: str, pattern: str) -> None:
    # No MASTER_ADDR: had init tried to create the process group first, it would fail with another error.
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    with pytest.raises(ValueError, match=pattern):
        smp.init({})
    assert not smp.is_initialized()


def test_world_of_one_without_launcher(monkeypatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match=r"call smp.init\(config\) before"):
        smp.rank()
    smp.init({})
    try:
        assert (smp.rank(), smp.size(), smp.sdp_size(), smp.rdp_size()) == (0, 1, 1, 1)
        assert smp.allgather("only") == ["only"]
        t = torch.arange(4.0)
        out = torch.empty(4)
        smp.get_engine().all_gather(out, t, smp.get_topology().sharding)
        assert torch.equal(out, t)
        with pytest.raises(RuntimeError, match="already called"):
            smp.init({})
    finally:
        smp.shutdown()
    assert not smp.is_initialized() and "WORLD_SIZE" not in os.environ


def _node_groups() -> dict:
    smp.init({"sharded_data_parallel_degree": 4, "ranks_per_node": 2, "ddp_dist_backend": "nccl"})
    topo = smp.get_topology()
    node, sharding_node = topo.group("node"), topo.group("sharding_node")
    return {
        "same_ranks": node.ranks == sharding_node.ranks,
        "shared": node.handle is sharding_node.handle,
        "others": [k for k, g in topo.groups.items() if k != "sharding_node" and g.handle is sharding_node.handle],
    }


def test_the_hierarchical_node_group_has_a_process_group_of_its_own(ranks) -> None:
    """Its step runs on the engine's chain thread; a process group shared with the "node" group (the
    same ranks at tp 1) would let the main thread's collectives and the chain's mismatch across ranks."""
    for r in ranks.run(4, _node_groups):
        assert r["same_ranks"] and not r["shared"] and not r["others"], r


def _groups_after_shutdown() -> dict:
    """Train a step, ask for every group the facade makes, shut down and drop the model: the groups must
    be freed (a gloo group holds 3 threads and a socket per peer while its object lives)."""
    import gc
    import weakref

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    smp.init({"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 10})
    torch.manual_seed(0)
    model = smp.DistributedModel(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    model.backward(model(torch.randn(8, 16)).sum())
    opt.step()
    opt.zero_grad()
    handles = {g.handle for g in smp.get_topology().groups.values()} | {smp.get_pp_process_group()}
    refs = [weakref.ref(pg) for pg in handles if isinstance(pg, dist.ProcessGroup) and pg is not dist.group.WORLD]
    del handles
    smp.shutdown()
    registered = len(distributed_c10d._world.pg_map)
    del model, opt
    gc.collect()  # the model's module <-> hook cycles are ordinary garbage; nothing may hold them from C++
    return {"made": len(refs), "alive": sum(r() is not None for r in refs), "registered": registered}


def test_shutdown_frees_the_groups_it_made(ranks) -> None:
    """Issue 29 item 8: post-accumulate-grad hooks, held by C++, kept every wrapped model and its groups
    alive for the life of the process, and smp.shutdown() left the pp group registered."""
    for rank, r in enumerate(ranks.run(4, _groups_after_shutdown)):
        assert r["made"] >= 2, (rank, r)  # the sharding / replication / node groups and the pp group
        assert r["registered"] == 1, f"rank {rank}: groups besides WORLD still registered after shutdown: {r}"
        assert r["alive"] == 0, f"rank {rank}: {r['alive']} of {r['made']} groups outlived shutdown and the model"
