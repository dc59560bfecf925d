"""PEFT LoRA fine-tuning under shardpar, FSDP2 and DDP side by side (issue 33 item 4).

Every framework trains the same GPT-NeoX (bench_memory.py's 168m / 563m dimensions) with a bf16 base and
PEFT LoRA r 16 (alpha 32, no dropout) on the attention and MLP linears (query_key_value, dense,
dense_h_to_4h, dense_4h_to_h; PEFT keeps the adapters in fp32), AdamW lr 1e-4, no clipping, on the same
random tokens (2 x 128 per rank), 4 ranks:

    shardpar  smp.DistributedModel(peft_model) at sdp 4, bf16, sdp_gradient_clipping 0; the frozen base is
              sharded in bf16 (runtime/frozen.py); --frozen-base-mode passes `sdp_frozen_base_mode`
              into the config unchanged (when that knob exists); checkpoint: smp.save_checkpoint(partial=True),
              adapter-only (checkpoint/fingerprint.py)
    fsdp2     fully_shard per GPT-NeoX layer and on the root of the PEFT model, MixedPrecisionPolicy(bf16
              params, fp32 reduce) -- without a param_dtype FSDP2 refuses a unit mixing the bf16 base and
              fp32 adapters; checkpoint: torch.distributed.checkpoint of get_model_state_dict +
              get_optimizer_state_dict with their defaults (the base included)
    ddp       DistributedDataParallel(peft_model) with its defaults; checkpoint as transformers' Trainer
              writes one for PEFT under DDP: rank 0 saves the adapter (save_pretrained) + optimizer.pt

Per framework: per-rank peak VmHWM over the whole run and over the training steps alone (VmHWM reset after
set-up, /proc/self/clear_refs), step median (slowest rank per step, after warm-up), bytes gathered per rank
per step (all-gather output bytes: shardpar's counting engine; for FSDP2 a counter around
torch.distributed.all_gather_into_tensor), checkpoint bytes and save time (slowest rank).

    .venv/bin/python benchmarks/bench_lora.py --model 168m
    .venv/bin/python benchmarks/bench_lora.py --model 563m --frameworks shardpar,fsdp2,ddp --steps 3
    .venv/bin/python benchmarks/bench_lora.py --model 168m --frameworks shardpar --frozen-base-mode int8

The base is built in bf16 (as `from_pretrained(..., dtype=torch.bfloat16)` loads one). shardpar's wrap hands
the freed full model back to the OS (malloc_trim, api/memory.py); --trim-after-setup does the same for
every framework after its set-up, and --mmap-threshold BYTES sets glibc's MALLOC_MMAP_THRESHOLD_ in every
rank (freed blocks of that size or more leave the heap at once), so that a peak can be read with and
without the allocator's retention.

Each framework runs in freshly spawned ranks, one framework at a time; --repeats N runs each N times in
rotated order (A B C, B C A, ...) and reports the median step and save time, the largest peaks.
Results: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

from spawn_ranks import collect, free_port  # benchmarks/, on the path when run as a script

# (hidden, layers, heads, intermediate, vocab) as bench_memory.py; "smoke" only checks the script runs
MODELS = {"168m": (768, 12, 12, 3072, 50304), "563m": (1024, 36, 16, 4096, 50304), "smoke": (128, 2, 4, 512, 1024)}
FRAMEWORKS = ("shardpar", "fsdp2", "ddp")
TARGETS = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
LR = 1e-4


@dataclass(frozen=True)
class Case:
    framework: str
    model: str
    world: int = 4
    sdp: int = 4
    batch: int = 2
    seq: int = 128
    rank_r: int = 16
    warmup: int = 1
    steps: int = 3
    frozen_base_mode: str | None = None
    ckpt_dir: str = ""
    trim_after_setup: bool = False


# ---- rank side ------------------------------------------------------------------------------------


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {key} in /proc/self/status")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS (Linux >= 4.0)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _peft_model(case: Case) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    hidden, layers, heads, inter, vocab = MODELS[case.model]
    cfg = GPTNeoXConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=inter, max_position_embeddings=max(case.seq, 128), hidden_dropout=0.0,
        attention_dropout=0.0, use_cache=False, tie_word_embeddings=False,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as from_pretrained(dtype=torch.bfloat16): never an fp32 copy
    try:
        base = GPTNeoXForCausalLM(cfg)
    finally:
        torch.set_default_dtype(dtype)
    lora = LoraConfig(r=case.rank_r, lora_alpha=2 * case.rank_r, target_modules=TARGETS, lora_dropout=0.0)
    return get_peft_model(base, lora)


class _GatherCounter:
    """Output bytes of every all-gather and input bytes of every reduce-scatter torch.distributed runs
    (FSDP2 calls all_gather_single / reduce_scatter_single in torch 2.13, *_tensor in older ones)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.gathered = self.scattered = 0
        for name in ("all_gather_into_tensor", "all_gather_single"):
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(getattr(dist, name), "output_tensor", 0, "gathered"))
        for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(getattr(dist, name), "input", 1, "scattered"))

    def _wrap(self, fn: Any, key: str, pos: int, field: str) -> Any:
        def counted(*a: Any, **k: Any) -> Any:
            t = a[pos] if len(a) > pos else k.get(key, k.get("input_tensor", k.get("output")))
            setattr(self, field, getattr(self, field) + t.numel() * t.element_size())
            return fn(*a, **k)

        return counted


def _setup(case: Case) -> tuple[Any, Any, Any, Any]:
    """(step, gathered_bytes() -> cumulative, save(dir), teardown) for the case's framework."""
    import torch
    import torch.distributed as dist

    if case.framework == "shardpar":
        import shardpar as smp

        config: dict[str, Any] = {"sharded_data_parallel_degree": case.sdp, "bf16": True, "sdp_gradient_clipping": 0.0}
        if case.frozen_base_mode is not None:
            config["sdp_frozen_base_mode"] = case.frozen_base_mode
        smp.init(config)
        model = smp.DistributedModel(_peft_model(case))
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR))

        def step(batch: dict[str, Any]) -> Any:
            loss = model(**batch).loss
            model.backward(loss)
            opt.step()
            opt.zero_grad()
            return loss

        def gathered() -> int:
            stats = smp.comm_stats()
            return sum(r.bytes for recs in [*stats.history, stats.current] for r in recs if r.op == "all_gather")

        def save(directory: str) -> None:
            smp.save_checkpoint(directory, "lora", model=model, optimizer=opt)

        return step, gathered, save, smp.shutdown

    dist.init_process_group("gloo")
    model = _peft_model(case)
    counter = _GatherCounter()
    if case.framework == "fsdp2":
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (case.sdp,), mesh_dim_names=("shard",))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.base_model.model.gpt_neox.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)

        def save(directory: str) -> None:
            import torch.distributed.checkpoint as dcp

            state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
            dcp.save(state, checkpoint_id=directory)

    else:
        from torch.nn.parallel import DistributedDataParallel

        peft_model, ddp = model, DistributedDataParallel(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)

        def save(directory: str) -> None:
            if dist.get_rank() == 0:  # transformers' Trainer for PEFT under DDP: the adapter + optimizer.pt
                peft_model.save_pretrained(directory)
                torch.save(opt.state_dict(), os.path.join(directory, "optimizer.pt"))

        model = ddp

    def step(batch: dict[str, Any]) -> Any:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step, lambda: counter.gathered, save, dist.destroy_process_group


def run_rank(case: Case, rank: int) -> dict[str, Any]:
    import ctypes
    import ctypes.util
    import gc

    import torch
    import torch.distributed as dist
    import transformers

    torch.set_num_threads(1)  # ranks share the cores
    transformers.logging.set_verbosity_error()
    step, gathered, save, teardown = _setup(case)
    gc.collect()
    if case.trim_after_setup:  # what shardpar's wrap does itself (api/memory.py), for every framework
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    setup_peak = _status_mib("VmHWM")
    _reset_hwm()
    times, per_step = [], []
    vocab = MODELS[case.model][4]
    for i in range(case.warmup + case.steps):
        g = torch.Generator().manual_seed(1000 * i + rank)
        ids = torch.randint(0, vocab, (case.batch, case.seq), generator=g)
        dist.barrier()
        before, t0 = gathered(), time.perf_counter()
        loss = step({"input_ids": ids, "labels": ids})
        times.append(time.perf_counter() - t0)
        per_step.append(gathered() - before)
    step_peak = _status_mib("VmHWM")
    directory = os.path.join(case.ckpt_dir, case.framework)
    dist.barrier()
    t0 = time.perf_counter()
    save(directory)
    dist.barrier()
    save_s = time.perf_counter() - t0
    out = {
        "times": times[case.warmup :],
        "gathered": per_step[case.warmup :],
        "step_peak": step_peak,
        "run_peak": max(setup_peak, step_peak),
        "save_s": save_s,
        "ckpt_bytes": _dir_bytes(directory) if rank == 0 else 0,
        "loss": float(loss.detach().float()),
    }
    teardown()
    return out


def _entry(case: Case, rank: int, port: int, queue: Any) -> None:
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(case.world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(case.world),
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )  # fmt: skip
    try:
        queue.put((rank, "ok", run_rank(case, rank)))
    except BaseException:
        queue.put((rank, "err", traceback.format_exc()))


# ---- parent side ------------------------------------------------------------------------------------


def launch(case: Case, timeout_s: float) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_entry, args=(case, r, port, queue)) for r in range(case.world)]
    for p in procs:
        p.start()
    return collect(procs, queue, case.world, timeout_s)


def adapter_state_mib(case: Case) -> float:
    """The adapters' fp32 values + AdamW's two moments: what an adapter-only checkpoint must hold."""
    hidden, layers, _, inter, _ = MODELS[case.model]
    numel = case.rank_r * (8 * hidden + 2 * inter) * layers  # A (r x in) + B (out x r) on the 4 linears
    return numel * 12 / 2**20


def summary(case: Case, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))]
    return {
        "framework": case.framework + (f" ({case.frozen_base_mode})" if case.frozen_base_mode else ""),
        "model": case.model,
        "step_s": statistics.median(steps),
        "step_peak_mib": max(r["step_peak"] for r in ranks),
        "run_peak_mib": max(r["run_peak"] for r in ranks),
        "gathered_mib": statistics.median(r["gathered"][-1] for r in ranks) / 2**20,
        "ckpt_mib": ranks[0]["ckpt_bytes"] / 2**20,
        "adapter_state_mib": adapter_state_mib(case),
        "save_s": max(r["save_s"] for r in ranks),
        "loss": statistics.mean(r["loss"] for r in ranks),
    }


def merge(found: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from a framework's repeats: median step and save times, the largest peaks."""
    row = dict(found[0])
    for key in ("step_s", "save_s", "gathered_mib"):
        row[key] = statistics.median(r[key] for r in found)
    for key in ("step_peak_mib", "run_peak_mib"):
        row[key] = max(r[key] for r in found)
    row["step_runs"] = [r["step_s"] for r in found]
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | framework | step median | peak / rank (steps) | peak / rank (run) | gathered / rank / step "
        "| checkpoint | save | last loss |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['framework']} | {r['step_s']:.2f} s | {r['step_peak_mib']:,.0f} MiB | "
            f"{r['run_peak_mib']:,.0f} MiB | {r['gathered_mib']:,.1f} MiB | {r['ckpt_mib']:,.2f} MiB "
            f"({r['ckpt_mib'] / r['adapter_state_mib']:.2f}x adapter + Adam) | {r['save_s']:.2f} s | {r['loss']:.5f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="168m", help="168m, 563m or both, comma-separated")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--frozen-base-mode", default=None, help="sdp_frozen_base_mode for shardpar (its default if unset)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="runs per framework, in rotated order")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--trim-after-setup", action="store_true", help="malloc_trim(0) after set-up, every framework")
    ap.add_argument(
        "--mmap-threshold", type=int, default=None,
        help="MALLOC_MMAP_THRESHOLD_ for every rank (bytes): blocks at least this large go back to the OS when freed",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.mmap_threshold is not None:  # glibc reads it when a spawned rank starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    frameworks = args.frameworks.split(",")
    for fw in frameworks:
        if fw not in FRAMEWORKS:
            raise SystemExit(f"--frameworks {fw!r}: one of {FRAMEWORKS}")
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        for model in args.model.split(","):
            if model not in MODELS:
                raise SystemExit(f"--model {model!r}: one of {sorted(MODELS)}")
            for rep in range(args.repeats):  # A B C, B C A, ...: the machine's drift hits every framework alike
                for fw in frameworks[rep % len(frameworks) :] + frameworks[: rep % len(frameworks)]:
                    mode = args.frozen_base_mode if fw == "shardpar" else None
                    case = Case(
                        fw, model, warmup=args.warmup, steps=args.steps, frozen_base_mode=mode, ckpt_dir=tmp,
                        trim_after_setup=args.trim_after_setup,
                    )  # fmt: skip
                    t0 = time.perf_counter()
                    row = summary(case, launch(case, args.timeout))
                    runs.setdefault((model, fw), []).append(row)
                    print(
                        f"{model} {fw} run {rep}: {time.perf_counter() - t0:.0f} s: {row}", file=sys.stderr, flush=True
                    )
    rows = [merge(found) for found in runs.values()]
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "case": asdict(Case("-", "-"))}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
