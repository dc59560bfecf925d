"""The rank side of bench_memory.py: build a GPT-NeoX under one framework, train a few steps, and read
the process's own peak RSS (VmHWM) around every phase.

Only the spawned ranks import this module. They are started with "spawn", so each measures its own
imports from a fresh interpreter, whatever the parent (bench_memory.py) has loaded.

Frameworks, each on CPU with gloo underneath:
    shardpar  smp.DistributedModel under smp.delay_param_initialization (a rank materialises only its
              shards), smp.DistributedOptimizer(AdamW); sdp and the knobs from the case
    fsdp2     torch's fully_shard per transformer layer and on the root (its usual wrapping), built on
              the meta device, then to_empty + re-initialised shards (FSDP2's delayed initialisation)
    ddp       torch DistributedDataParallel with its defaults; every rank builds the whole model
"""

from __future__ import annotations

import datetime
import os
import re
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class MemCase:
    framework: str  # shardpar | fsdp2 | ddp
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    world: int
    sdp: int
    batch: int = 1
    seq: int = 128
    steps: int = 3
    bucket: int = int(5e8)  # sdp_reduce_bucket_size (shardpar)
    max_live: int = int(1e9)  # sdp_max_live_parameters (shardpar)
    checkpointing: bool = False  # HF gradient checkpointing, non-reentrant
    backend: str = "auto"  # ddp_dist_backend (shardpar)
    persistence: int = int(1e6)  # sdp_param_persistence_threshold (shardpar)
    precision: str = "fp32"  # fp32 | bf16 | fp16 (shardpar)
    shard_optimizer_state: bool = False  # (shardpar)


def status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if m is None:
        raise AssertionError(f"no {key} in /proc/self/status")
    return int(m.group(1)) / 1024


def reset_hwm() -> None:
    """VmHWM := the current RSS (Linux >= 4.0), so the next read is the peak since now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def neox_config(case: MemCase) -> Any:
    from transformers import GPTNeoXConfig

    cfg = GPTNeoXConfig(
        vocab_size=case.vocab,
        hidden_size=case.hidden,
        num_hidden_layers=case.layers,
        num_attention_heads=case.heads,
        intermediate_size=case.intermediate,
        max_position_embeddings=max(case.seq, 128),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cache=False,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def _checkpointing(module: torch.nn.Module, case: MemCase) -> None:
    if case.checkpointing:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# ---- the frameworks: (model, optimizer step, teardown) -------------------------------------------


def build_shardpar(case: MemCase) -> tuple[Any, Any, Any]:
    from transformers import GPTNeoXForCausalLM

    import shardpar as smp

    with smp.delay_param_initialization():
        module = GPTNeoXForCausalLM(neox_config(case))
    _checkpointing(module, case)
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    return model, opt, smp.shutdown


def _fsdp2_init_shards(model: torch.nn.Module) -> None:
    """Values for the sharded parameters after to_empty (FSDP2's meta-device recipe): N(0, 0.02),
    layer-norm weights 1 -- what training needs to stay finite; the benchmark reads memory only."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if "layernorm" in name or "layer_norm" in name:
                local.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                local.normal_(0.0, 0.02)


def build_fsdp2(case: MemCase) -> tuple[Any, Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import GPTNeoXForCausalLM
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    mesh = init_device_mesh("cpu", (case.sdp,), mesh_dim_names=("shard",))
    cfg = neox_config(case)
    with torch.device("meta"):
        model = GPTNeoXForCausalLM(cfg)
    _checkpointing(model, case)
    for layer in model.gpt_neox.layers:  # one unit per layer, like shardpar's blocks
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    _fsdp2_init_shards(model)
    model.gpt_neox.rotary_emb = GPTNeoXRotaryEmbedding(config=cfg)  # its buffers were left empty
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, None


def build_ddp(case: MemCase) -> tuple[Any, Any, Any]:
    from torch.nn.parallel import DistributedDataParallel
    from transformers import GPTNeoXForCausalLM

    module = GPTNeoXForCausalLM(neox_config(case))
    _checkpointing(module, case)
    model = DistributedDataParallel(module)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, None


BUILDERS = {"shardpar": build_shardpar, "fsdp2": build_fsdp2, "ddp": build_ddp}


def _init(case: MemCase) -> None:
    if case.framework == "shardpar":
        import shardpar as smp

        smp.init(
            {
                "sharded_data_parallel_degree": case.sdp,
                "sdp_reduce_bucket_size": case.bucket,
                "sdp_max_live_parameters": case.max_live,
                "ddp_dist_backend": case.backend,
                "sdp_param_persistence_threshold": case.persistence,
                "shard_optimizer_state": case.shard_optimizer_state,
                **({} if case.precision == "fp32" else {case.precision: True}),
            }
        )
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))


def _imports(case: MemCase) -> None:
    """What each framework imports before its baseline, so the baseline holds all of them."""
    import warnings

    import transformers
    import transformers.models.gpt_neox.modeling_gpt_neox

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    if case.framework == "shardpar":
        import shardpar  # noqa: F401
    elif case.framework == "fsdp2":
        import torch.distributed.fsdp  # noqa: F401


def run_rank(case: MemCase, rank: int) -> dict[str, Any]:
    """Build and train; every figure in MiB of this process's RSS:

    baseline  RSS after imports and process-group start, before the model exists (the framework)
    build     the lifetime peak up to the end of building the model and its optimizer
    forward / backward / optimizer   the peak of each phase, highest over the steps (absolute)
    states    RSS at the end of the last backward: model states with their gradients, and the baseline
    peak      max(build, the phases): the process's VmHWM over its whole life
    """
    torch.set_num_threads(1)  # ranks share 2 cores
    _imports(case)
    _init(case)
    baseline = status_mib("VmRSS")
    t0 = time.perf_counter()
    model, opt, teardown = BUILDERS[case.framework](case)
    build_s = time.perf_counter() - t0
    build = status_mib("VmHWM")
    numel = sum(p.numel() for p in (model.module if case.framework == "ddp" else model).parameters())
    if case.framework == "shardpar":
        numel = sum(u.layout.numel for u in model.units) + sum(p.numel() for p in model.persistent.params)
    phases = dict.fromkeys(PHASES, 0.0)
    g = torch.Generator().manual_seed(rank)
    states, step_s = 0.0, []
    for _ in range(case.steps):
        ids = torch.randint(0, case.vocab, (case.batch, case.seq), generator=g)
        t = time.perf_counter()
        reset_hwm()
        loss = model(input_ids=ids, labels=ids).loss
        phases["forward"] = max(phases["forward"], status_mib("VmHWM"))
        reset_hwm()
        if case.framework == "shardpar":
            model.backward(loss)
        else:
            loss.backward()
        del loss
        phases["backward"] = max(phases["backward"], status_mib("VmHWM"))
        states = status_mib("VmRSS")
        reset_hwm()
        opt.step()
        opt.zero_grad(set_to_none=True)
        phases["optimizer"] = max(phases["optimizer"], status_mib("VmHWM"))
        step_s.append(time.perf_counter() - t)
    if teardown is not None:
        teardown()
    elif dist.is_initialized():
        dist.destroy_process_group()
    return {
        "numel": numel,
        "baseline": baseline,
        "build": build,
        "states": states,
        **phases,
        "peak": max(build, *phases.values()),
        "build_s": build_s,
        "step_s": sorted(step_s)[len(step_s) // 2],
        "steps_s": step_s,
        "pid": os.getpid(),
    }
