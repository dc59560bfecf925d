"""The rank side of bench_nodes.py (and tests/multiproc/test_nodes.py): started by torchrun inside an
emulated node (emulated_nodes.launch), it trains bench_step's GPT-NeoX under each requested layout in
turn, in the same processes, and writes its result with emulated_nodes.write_result.

Every layout trains the same model from the same seed on the same global batch: step s, micro-batch m
is a batch of B x world sequences, rank r takes rows [r B, (r+1) B) -- so a single process training
on the whole batch is the parity reference. fp32 AdamW, global-norm clipping 1.0, k micro-batches per
step, each loss divided by k; the gradient sync runs only on the last micro-batch where the framework
lets a user say so (DDP no_sync, FSDP2 set_requires_gradient_sync, shardpar backward_passes_per_step).

Per measured step each rank records its wall time, its mean loss, and -- the rank with local rank 0,
after a barrier -- its node's link counters (tx, rx bytes), read at every step boundary.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import emulated_nodes
import torch
import torch.distributed as dist
from step_setups import VOCAB, build_model

LAYOUTS = (
    "shardpar-node",
    "shardpar-span",
    "shardpar-span-min",
    "shardpar-span-int8",
    "fsdp2-full",
    "fsdp2-hsdp",
    "ddp",
    "deepspeed-z3",
    "probe",
)
# shardpar's spanning layouts beyond the defaults (two-hop ReduceScatter, hierarchical AllGather):
# "min" gathers across nodes once a step and reduces across them once a step (issue 28's knobs),
# "int8" also quantizes both cross-node hops.
SPAN_KNOBS: dict[str, dict[str, bool]] = {
    "shardpar-span": {},
    "shardpar-span-min": {"sdp_node_secondary_shard": True, "sdp_defer_cross_node_reduce": True},
    "shardpar-span-int8": {
        "sdp_node_secondary_shard": True,
        "sdp_defer_cross_node_reduce": True,
        "sdp_quantize_cross_node_weights": True,
        "sdp_quantize_cross_node_gradients": True,
    },
}
# What shardpar's own arithmetic (shardpar.cli.cross_node.model_traffic) says the last built layout
# sends out of each node per step: the figure the link counters are held to.
_MODELLED: dict[str, float] = {}
Batch = dict[str, torch.Tensor]
# step(micro_batches) -> mean loss; done() -> full parameters (rank 0; None where not exported)
Trainer = tuple[Callable[[list[Batch]], float], Callable[[], dict[str, torch.Tensor] | None], Callable[[], None]]


def counters_between_barriers(reader: bool) -> tuple[int, int]:
    """This node's link counters, read while every rank waits: a barrier before (every rank finished
    what came before) and one after (no rank starts what comes next until the reader has read). With
    the first alone, a rank of this node could start sending the next collective while a descheduled
    reader had not read yet, moving those bytes out of the window (seen on a loaded machine: an
    all_gather measured at 0.82 x its ring bytes)."""
    dist.barrier()
    now = link_counters() if reader else (0, 0)
    dist.barrier()
    return now


def link_counters() -> tuple[int, int]:
    """(tx, rx) bytes of this node's link (/sys is the namespace's under `ip netns exec`)."""
    base = f"/sys/class/net/{os.environ[emulated_nodes.LINK_ENV]}/statistics"
    with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


def global_micro_batches(step: int, accum: int, rows: int, seq: int) -> list[Batch]:
    """Step `step`'s k micro-batches of the whole world (`rows` = B x world): the reference's input."""
    out = []
    for m in range(accum):
        g = torch.Generator().manual_seed(10_000 * step + m)
        ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def _mine(batches: list[Batch], rank: int, b: int) -> list[Batch]:
    return [{k: v[rank * b : (rank + 1) * b] for k, v in mb.items()} for mb in batches]


def _torch_loop(model: torch.nn.Module, opt: torch.optim.Optimizer, clip: float, sync: Callable[[bool], Any]) -> Any:
    """Plain PyTorch accumulation: `sync(last)` is entered around each micro-batch's forward+backward."""

    def step(mbs: list[Batch]) -> float:
        total = 0.0
        for i, mb in enumerate(mbs):
            with sync(i == len(mbs) - 1):
                loss = model(**mb).loss
                (loss / len(mbs)).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        return total / len(mbs)

    return step


def setup_shardpar(args: argparse.Namespace, sdp: int, knobs: dict[str, bool] | None = None) -> Trainer:
    import shardpar as smp
    from shardpar.cli.cross_node import model_traffic

    smp.init(
        {
            "ddp_dist_backend": args.backend,
            "sharded_data_parallel_degree": sdp,
            "sdp_param_persistence_threshold": args.persistence_threshold,
            "sdp_gradient_clipping": args.clip,
            **(knobs or {}),
            # ranks_per_node: None = LOCAL_WORLD_SIZE, which torchrun sets to the node's ranks
        }
    )
    model = smp.DistributedModel(build_model(args.model, args.seq), backward_passes_per_step=args.accum)
    _MODELLED["bytes"] = model_traffic(model, args.accum).total
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr, eps=args.eps))

    def step(mbs: list[Batch]) -> float:
        total = 0.0
        for mb in mbs:
            loss = model(**mb).loss
            model.backward(loss / len(mbs))  # the replica AllReduce runs in the last backward
            total += loss.item()
        opt.step()  # clips first
        opt.zero_grad()
        return total / len(mbs)

    return step, lambda: {k: v.detach().clone() for k, v in model.state_dict().items()}, smp.shutdown


def setup_fsdp2(args: argparse.Namespace, hsdp: bool) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world, local = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    if hsdp:  # replicate across nodes, shard inside a node
        mesh = init_device_mesh("cpu", (world // local, local), mesh_dim_names=("rep", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model: Any = build_model(args.model, args.seq)
    for layer in model.gpt_neox.layers:  # one unit per layer, like shardpar's
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=args.eps)

    @contextlib.contextmanager
    def sync(last: bool) -> Iterator[None]:
        model.set_requires_gradient_sync(last)  # no RS / AR before the last
        yield

    def full() -> dict[str, torch.Tensor]:
        return {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in model.state_dict().items()
        }

    return _torch_loop(model, opt, args.clip, sync), full, lambda: None


def setup_ddp(args: argparse.Namespace) -> Trainer:
    from torch.nn.parallel import DistributedDataParallel as DDP

    inner = build_model(args.model, args.seq)
    # broadcast_buffers off: GPT-NeoX's buffers (rotary tables) never change; on, each forward would
    # broadcast them from rank 0 across the link
    model = DDP(inner, broadcast_buffers=False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=args.eps)

    def sync(last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if last else model.no_sync()

    return _torch_loop(model, opt, args.clip, sync), lambda: dict(inner.state_dict()), lambda: None


def setup_deepspeed(args: argparse.Namespace) -> Trainer:
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # keeps the group already there
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": args.clip,
        "communication_data_type": "fp32",
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": args.persistence_threshold},
        "steps_per_print": 10**9,
    }
    model = build_model(args.model, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=args.eps)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(mbs: list[Batch]) -> float:
        total = 0.0
        for mb in mbs:
            loss = engine(**mb).loss
            engine.backward(loss)  # scaled by 1 / gradient_accumulation_steps inside
            engine.step()  # steps (clipping first) only at the accumulation boundary
            total += loss.item()
        return total / len(mbs)

    return step, lambda: None, lambda: None


def build(layout: str, args: argparse.Namespace) -> Trainer:
    local, world = int(os.environ["LOCAL_WORLD_SIZE"]), dist.get_world_size()
    if layout == "shardpar-node":
        return setup_shardpar(args, local)
    if layout in SPAN_KNOBS:
        return setup_shardpar(args, world, SPAN_KNOBS[layout])
    if layout in ("fsdp2-full", "fsdp2-hsdp"):
        return setup_fsdp2(args, hsdp=layout == "fsdp2-hsdp")
    if layout == "ddp":
        return setup_ddp(args)
    if layout == "deepspeed-z3":
        return setup_deepspeed(args)
    raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS}")


def run_layout(layout: str, args: argparse.Namespace) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    reader = int(os.environ["LOCAL_RANK"]) == 0
    torch.manual_seed(0)
    _MODELLED.clear()
    step, full_params, teardown = build(layout, args)
    times, losses, tx, rx = [], [], [], []
    counters = (0, 0)
    for s in range(args.warmup + args.steps):
        mbs = _mine(global_micro_batches(s, args.accum, args.batch * world, args.seq), rank, args.batch)
        now = counters_between_barriers(reader)  # every rank is between steps: whole steps only
        if reader:
            if s > args.warmup:
                tx.append(now[0] - counters[0])
                rx.append(now[1] - counters[1])
            counters = now
        t0 = time.perf_counter()
        loss = step(mbs)
        if s >= args.warmup:
            times.append(time.perf_counter() - t0)
            losses.append(loss)
    now = counters_between_barriers(reader)
    if reader:
        tx.append(now[0] - counters[0])
        rx.append(now[1] - counters[1])
    params = full_params()
    if params is not None and args.save_params and rank == 0:
        torch.save({k: v.float().contiguous() for k, v in params.items()}, f"{args.save_params}/{layout}.pt")
    teardown()
    result = {"layout": layout, "times": times, "loss": losses, "tx": tx, "rx": rx}
    if "bytes" in _MODELLED:
        result["modelled"] = _MODELLED["bytes"]
    return result


def probe(args: argparse.Namespace) -> dict[str, Any]:
    """Link bytes of single gloo collectives of `args.probe_mib` MiB: a node-local all_reduce (which
    must not cross the link) and all_reduce / all_gather / reduce_scatter over the world."""
    world, local = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    node = dist.get_rank() // local
    groups = [dist.new_group(list(range(n * local, (n + 1) * local))) for n in range(world // local)]
    numel = args.probe_mib * 2**20 // 4
    x = torch.ones(numel)
    ops: dict[str, Callable[[], Any]] = {
        "all_reduce_node_local": lambda: dist.all_reduce(x, group=groups[node]),
        "all_reduce_world": lambda: dist.all_reduce(x),
        "all_gather_world": lambda: dist.all_gather_into_tensor(torch.empty(numel * world), x),
        "reduce_scatter_world": lambda: dist.reduce_scatter_tensor(torch.empty(numel // world), x),
    }
    out: dict[str, Any] = {"layout": "probe", "bytes": numel * 4}
    for name, op in ops.items():
        reader = int(os.environ["LOCAL_RANK"]) == 0
        before = counters_between_barriers(reader)
        op()
        after = counters_between_barriers(reader)
        out[name] = [after[0] - before[0], after[1] - before[1]]
    return out


def params_count(model: str, threshold: int) -> dict[str, int]:
    """Parameters in all, those under the persistence threshold (replicated by shardpar), and the
    root's (outside the layers: embeddings, final norm), which shardpar and FSDP2 keep gathered from
    forward to backward instead of gathering again."""
    m: Any = build_model(model, 8)
    in_layers = {id(p) for p in m.gpt_neox.layers.parameters()}
    sizes = [(p.numel(), id(p) in in_layers) for p in m.parameters()]
    return {
        "params": sum(n for n, _ in sizes),
        "persistent": sum(n for n, _ in sizes if n < threshold),
        "root": sum(n for n, layer in sizes if not layer),
        "root_persistent": sum(n for n, layer in sizes if not layer and n < threshold),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--layouts", default="shardpar-node")
    p.add_argument("--model", default="small")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--backend", default="auto", help="shardpar's ddp_dist_backend")
    p.add_argument("--persistence-threshold", type=int, default=1000)
    p.add_argument("--save-params", default="", help="rank 0 saves each layout's final parameters here")
    p.add_argument("--probe-mib", type=int, default=8)
    return p.parse_args(argv)


def main() -> None:
    args = parse()
    torch.set_num_threads(1)  # the ranks share this machine's cores
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    results = []
    for layout in args.layouts.split(","):
        results.append(probe(args) if layout == "probe" else run_layout(layout, args))
    emulated_nodes.write_result(
        {"rank": dist.get_rank(), "local_rank": int(os.environ["LOCAL_RANK"]), "layouts": results}
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
