"""The rank side of bench_step.py: the model, the data, one training step per framework, the timed loop.

Only the spawned ranks import this module (it imports torch; bench_step.py's parent must not).
"""

from __future__ import annotations

import contextlib
import cProfile
import datetime
import functools
import io
import logging
import os
import pstats
import resource
import sys
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from bench_step import machine_busy_s

if TYPE_CHECKING:
    from bench_step import Case

VOCAB = 1024
MODELS: dict[str, dict[str, int]] = {
    # 3.7M parameters: the "hidden 256, 4 layers, vocab 1024".
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 1024},
    # 26.3M parameters.
    "25m": {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "intermediate_size": 2048},
}
LR = 1e-3
CLIP = 1.0

Batch = dict[str, torch.Tensor]
Step = Callable[[Batch], torch.Tensor]
# A step calls _mark() when its forward and its backward end; the loop reads the phase times from here.
_MARKS: list[float] = []


def _mark() -> None:
    _MARKS.append(time.perf_counter())


def build_model(model: str, seq: int) -> torch.nn.Module:
    """The same GPT-NeoX, from the same seed, for every framework (no dropout, so steps are deterministic)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(
        vocab_size=VOCAB,
        max_position_embeddings=seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cache=False,
        **MODELS[model],
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return GPTNeoXForCausalLM(cfg)


def batches(case: Case, data_rank: int) -> list[Batch]:
    """Random tokens, a different batch per step and per data-parallel rank, the same for every framework."""
    out = []
    for step in range(case.warmup + case.steps):
        g = torch.Generator().manual_seed(step * 1000 + data_rank)
        ids = torch.randint(0, VOCAB, (case.batch, case.seq), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def _destroy_gloo() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _init_gloo(case: Case) -> Callable[[], None]:
    if case.world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    return _destroy_gloo


def make_optimizer(kind: str, model: torch.nn.Module) -> Any:
    """AdamW; or torch.optim.Muon's recipe (Muon for the blocks' 2-D matrices, AdamW for embeddings, head,
    norms and biases), or torch.optim.Adafactor: both stepped whole on owner ranks under shardpar."""
    named = list(model.named_parameters())
    if kind == "muon":
        hidden = [p for n, p in named if p.dim() == 2 and ".layers." in n]  # GPT-NeoX's blocks
        ids = {id(p) for p in hidden}
        rest = [p for _, p in named if id(p) not in ids]
        return [torch.optim.Muon(hidden, lr=LR), torch.optim.AdamW(rest, lr=LR)]
    if kind == "adafactor":
        return torch.optim.Adafactor(model.parameters(), lr=LR)
    return torch.optim.AdamW(model.parameters(), lr=LR)


def setup_shardpar(
    case: Case, *, backend: str = "auto", compile: bool = False, optimizer: str = "adamw"
) -> tuple[Step, Callable[[], None]]:
    """shardpar with its defaults; `backend` = ddp_dist_backend ("auto" is the smddp engine on CPU);
    `compile`: torch.compile (inductor) of the wrapped model (the warm-up steps absorb the compilation);
    `optimizer`: make_optimizer's kind."""
    import shardpar as smp

    smp.init(
        {
            "ddp_dist_backend": backend,
            "sharded_data_parallel_degree": case.sdp,
            "bf16": case.dtype == "bf16",
            "sdp_param_persistence_threshold": case.persistence_threshold,
            "sdp_gradient_clipping": CLIP,
        }
    )
    model = smp.DistributedModel(build_model(case.model, case.seq))
    opt = smp.DistributedOptimizer(make_optimizer(optimizer, model))
    run = torch.compile(model) if compile else model

    def step(batch: Batch) -> torch.Tensor:
        loss = run(**batch).loss
        _mark()
        model.backward(loss)
        _mark()
        opt.step()  # clips to sdp_gradient_clipping first
        opt.zero_grad()
        return loss

    return step, smp.shutdown


def setup_fsdp2(case: Case) -> tuple[Step, Callable[[], None]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    teardown = _init_gloo(case)
    replicas = case.world // case.sdp
    if replicas > 1:  # HSDP: shard inside a group of sdp ranks, replicate across groups (docs/design.md section 22)
        mesh = init_device_mesh("cpu", (replicas, case.sdp), mesh_dim_names=("rep", "shard"))
    else:
        mesh = init_device_mesh("cpu", (case.sdp,), mesh_dim_names=("shard",))
    policy = MixedPrecisionPolicy()
    if case.dtype == "bf16":  # gather and compute in bf16, reduce in fp32: shardpar's bf16 defaults
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = build_model(case.model, case.seq)
    for layer in model.gpt_neox.layers:  # one unit per layer, like shardpar's default units
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return _torch_step(model, opt, autocast=False), teardown


def setup_deepspeed(case: Case) -> tuple[Step, Callable[[], None]]:
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    config = {
        "train_micro_batch_size_per_gpu": case.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "bf16": {"enabled": case.dtype == "bf16"},
        "communication_data_type": "fp32",  # reduce in fp32, like shardpar and FSDP2 here
        "zero_allow_untested_optimizer": True,
        # ZeRO-3 shards over the whole world: its MiCS mode (a sharding group smaller than the world)
        # was deleted upstream, so at world 4 it shards over 4 where shardpar and FSDP2 shard over 2.
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": case.persistence_threshold},
        "steps_per_print": 10**9,
    }
    model = build_model(case.model, case.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(batch: Batch) -> torch.Tensor:
        loss = engine(**batch).loss
        _mark()
        engine.backward(loss)
        _mark()
        engine.step()  # clips, steps and zeroes the gradients
        return loss

    return step, _destroy_gloo


def setup_plain(case: Case) -> tuple[Step, Callable[[], None]]:
    # At world > 1 the process group only serves the timing barrier: each rank trains its own copy,
    # without communicating -- the compute floor of that many ranks on this machine's cores.
    teardown = _init_gloo(case)
    model = build_model(case.model, case.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return _torch_step(model, opt, autocast=case.dtype == "bf16"), teardown


SETUPS = {
    "shardpar": setup_shardpar,
    "fsdp2": setup_fsdp2,
    "deepspeed": setup_deepspeed,
    "plain": setup_plain,
    "shardpar-native": functools.partial(setup_shardpar, backend="nccl"),  # gloo on CPU
    "shardpar-compile": functools.partial(setup_shardpar, compile=True),
    "shardpar-muon": functools.partial(setup_shardpar, optimizer="muon"),  # owner compute (issue 31)
    "shardpar-adafactor": functools.partial(setup_shardpar, optimizer="adafactor"),
}


def _import_framework(framework: str) -> None:
    """Import what the framework needs before the RSS baseline, so 'growth' counts training memory."""
    import transformers
    import transformers.models.gpt_neox.modeling_gpt_neox  # lazy in transformers: ~100 MiB

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    if framework.startswith("shardpar"):
        import shardpar  # noqa: F401
    elif framework == "fsdp2":
        import torch.distributed.fsdp  # noqa: F401
    elif framework == "deepspeed":
        import deepspeed  # noqa: F401


def _primer_step() -> None:
    """A tiny plain step in fp32 and bf16, so the lazy set-up every framework's step needs (autograd,
    AdamW, autocast kernels) lands in the RSS baseline rather than in one framework's growth."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    model = GPTNeoXForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = torch.randint(0, 64, (2, 16))
    for bf16 in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()


def _shm_rss_mib() -> float:
    """Resident shared memory now (/proc: RssShmem), e.g. shared-memory transport segments; part of RSS."""
    with open("/proc/self/status") as f:
        kib = next((int(ln.split()[1]) for ln in f if ln.startswith("RssShmem:")), 0)
    return kib / 1024


def _minor_faults() -> int:
    """Page faults served without I/O so far: a fresh buffer faults once per 4 KiB page it touches,
    which costs more than the copy itself on this VM (docs/performance-history.md, items 6 and 7)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def run_rank(case: Case, rank: int) -> dict[str, Any]:
    """Warm-up and measured steps on this rank; per-step wall time and phases, peak RSS, last loss."""
    # Ranks share the cores: one intra-op thread per rank, all cores for a single rank.
    threads = 1 if case.world > 1 else max(1, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    _import_framework(case.framework)
    _primer_step()
    baseline = _peak_rss_mib()
    step, teardown = SETUPS[case.framework.split("@")[0]](case)  # shardpar@REV runs like shardpar
    torch.set_num_threads(threads)  # in case the framework changed it
    times, phases, cpu, busy, faults, loss = [], [], [], [], [], torch.zeros(())
    for batch in batches(case, data_rank=rank):
        _barrier(case.world)
        _MARKS.clear()
        t0, c0, b0, f0 = time.perf_counter(), time.process_time(), machine_busy_s(), _minor_faults()
        loss = step(batch)
        t1 = time.perf_counter()
        faults.append(_minor_faults() - f0)
        fwd_end, bwd_end = _MARKS
        times.append(t1 - t0)
        phases.append((fwd_end - t0, bwd_end - fwd_end, t1 - bwd_end))
        cpu.append(time.process_time() - c0)  # this rank, all its threads
        busy.append(machine_busy_s() - b0)  # the whole machine
    peak, shm = _peak_rss_mib(), _shm_rss_mib()
    if case.profile_dir is not None:
        profile_step(case, rank, step, batches(case, data_rank=rank)[-1])
    teardown()
    return {
        "times": times[case.warmup :],
        "phases": phases[case.warmup :],
        "cpu": cpu[case.warmup :],
        "busy": busy[case.warmup :],
        "faults": faults[case.warmup :],
        "loss": float(loss.detach().float()),
        "peak": peak,
        "shm": shm,
        "baseline": baseline,
        "shardpar_file": getattr(sys.modules.get("shardpar"), "__file__", None),
    }


def profile_step(case: Case, rank: int, step: Step, batch: Batch) -> None:
    """One more step under torch.profiler and one under cProfile; their tables go to profile_dir."""
    os.makedirs(case.profile_dir or ".", exist_ok=True)
    stem = os.path.join(case.profile_dir or ".", f"{case.framework}_{case.model}_w{case.world}_{case.dtype}_r{rank}")
    _barrier(case.world)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(batch)
    with open(stem + "_torch.txt", "w") as f:
        f.write(f"step wall {(time.perf_counter() - t0) * 1e3:.1f} ms under torch.profiler\n")
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    _barrier(case.world)
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.runcall(step, batch)
    buf = io.StringIO()
    buf.write(f"step wall {(time.perf_counter() - t0) * 1e3:.1f} ms under cProfile\n")
    pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(40)
    pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(40)
    with open(stem + "_cprofile.txt", "w") as f:
        f.write(buf.getvalue())


def _torch_step(model: torch.nn.Module, opt: torch.optim.Optimizer, *, autocast: bool) -> Step:
    """Forward (under bf16 autocast if asked), backward, clip, optimizer step, zero_grad: plain
    PyTorch's training step, which FSDP2 runs unchanged."""

    def step(batch: Batch) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = model(**batch).loss
        _mark()
        loss.backward()
        _mark()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        return loss

    return step
