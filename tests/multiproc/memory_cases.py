"""Cases for test_memory.py: gathered memory measured from outside (the rank's RSS), issue 19.

The model is built so that gathered units dominate everything else a step allocates: six blocks of
two 2048 x 2048 Linear layers (8.4M elements, 33.6 MB in fp32 each), a root of ~50K elements, and a
batch of 4 rows, so activations are a few hundred KB. A rank's RSS then moves by whole units.

RSS only falls when the allocator gives freed blocks back to the OS. glibc serves a block from mmap
only above its mmap threshold, which grows with every freed mmapped block up to 32 MiB; a unit here
is just above 32 MiB and its gradients (16.8 MB a weight) are below. So the pool runs with
MALLOC_MMAP_THRESHOLD_=1 MiB in its environment (test_memory.py), and because glibc has read its
environment long before a pool's worker sets it, the case applies it itself with mallopt(), which
also turns the dynamic threshold off: every block of 1 MiB or more is mmapped and returned on free.

Each phase's peak is VmHWM after writing 5 to /proc/self/clear_refs (which resets VmHWM to the
current RSS) at its start, minus the RSS at its start.
"""

from __future__ import annotations

import ctypes
import os
import re
from typing import Any

import torch
from torch import nn

import shardpar as smp

WIDTH, NUM_BLOCKS, ROWS = 2048, 6, 4
LR = 0.02  # grad norm ~15 at step 0: a larger step makes step 1 chaotic
_M_MMAP_THRESHOLD = -3  # glibc malloc.h


class WideBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, WIDTH)
        self.down = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(h)))


class WideNet(nn.Module):
    """Gathered units large against everything else; `checkpoint` = None, or use_reentrant."""

    def __init__(self, checkpoint: bool | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList(WideBlock() for _ in range(NUM_BLOCKS))
        self.head = nn.Linear(WIDTH, 5)
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            if self.checkpoint is None:
                h = b(h)
            else:
                h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=self.checkpoint)
        return nn.functional.cross_entropy(self.head(h), y)


def wide_batch(step: int, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"x": torch.randn(n, 16, generator=g), "y": torch.randint(0, 5, (n,), generator=g)}


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if m is None:
        raise AssertionError(f"no {key} in /proc/self/status")
    return int(m.group(1))


class Phase:
    """A phase's RSS peak (VmHWM, reset through clear_refs when the phase starts) and what it keeps
    (RSS at its end), both counted from `base` bytes (default: the RSS at its start)."""

    def __init__(self, base: int | None = None) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = _status_kib("VmRSS") * 1024 if base is None else base

    def end(self) -> dict[str, int]:
        return {"peak": _status_kib("VmHWM") * 1024 - self.base, "kept": _status_kib("VmRSS") * 1024 - self.base}


def _apply_mmap_threshold() -> int:
    threshold = int(os.environ.get("MALLOC_MMAP_THRESHOLD_", "0"))
    if not threshold:
        raise AssertionError("run this case in a pool with MALLOC_MMAP_THRESHOLD_ set (test_memory.py)")
    if ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold) != 1:
        raise AssertionError("mallopt(M_MMAP_THRESHOLD) failed")
    return threshold


def gathered_rss_case(checkpoint: bool | None, *, steps: int = 2) -> dict[str, Any]:
    """Train WideNet at sdp 2 with sdp_max_live_parameters = one block and a reduce bucket of one
    block; per step, the RSS peaks of forward and of backward, counted from the step's start. Then
    the same steps on one process."""
    _apply_mmap_threshold()
    torch.manual_seed(0)
    probe = WideNet(checkpoint)
    block = sum(p.numel() for p in probe.blocks[0].parameters())
    root = sum(p.numel() for n, p in probe.named_parameters() if not n.startswith("blocks"))
    del probe
    world = 2
    smp.init(
        {
            "sharded_data_parallel_degree": 2,
            "sdp_param_persistence_threshold": 0,
            "sdp_max_live_parameters": block,
            "sdp_reduce_bucket_size": block,
            "sdp_gradient_clipping": 0.0,  # the reference below does not clip
        }
    )
    rank = smp.rank()
    torch.manual_seed(0)
    model = smp.DistributedModel(WideNet(checkpoint))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    phases, losses = [], []
    for step in range(steps):
        batch = {k: v[rank * ROWS : (rank + 1) * ROWS] for k, v in wide_batch(step, ROWS * world).items()}
        fwd = Phase()
        loss = model(**batch)
        forward = fwd.end()
        bwd = Phase(fwd.base)  # counted from the step's start: what forward kept is part of it
        model.backward(loss)
        backward = bwd.end()
        opt.step()
        opt.zero_grad()
        phases.append({"forward": forward, "backward": backward})
        losses.append(sum(smp.allgather(loss.item(), smp.CommGroup.RDP_GROUP)) / world)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    max_live = model.live.peak
    smp.shutdown()
    del model, opt

    torch.manual_seed(0)
    ref = WideNet(checkpoint)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    ref_losses = []
    for step in range(steps):
        loss = ref(**wide_batch(step, ROWS * world))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    param_diff = max((state[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return {
        "phases": phases,
        "block_bytes": block * 4,  # sdp 2 pads to even: both sizes are even already
        "root_bytes": root * 4,
        "max_live": max_live,
        "losses": losses,
        "ref_losses": ref_losses,
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "param_diff": param_diff,
    }


def hf_checkpointing_cap_case(use_reentrant: bool) -> dict[str, Any]:
    """HF gradient checkpointing on tiny GPT-NeoX at sdp 2 with sdp_max_live_parameters = one layer:
    recomputation in backward gathers each layer again; the gathered peak and parity vs one process."""
    from tests import models

    probe = models.tiny_neox()
    layer = sum(p.numel() for p in probe.gpt_neox.layers[0].parameters())
    root = sum(p.numel() for n, p in probe.named_parameters() if ".layers." not in n)
    smp.init(
        {
            "sharded_data_parallel_degree": 2,
            "sdp_param_persistence_threshold": 0,
            "sdp_max_live_parameters": layer,
            "sdp_gradient_clipping": 0.0,
        }
    )
    module = models.tiny_neox()
    module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model = smp.DistributedModel(module)
    model.set_live_trace(True)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref = models.tiny_neox()
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model.train()
    ref.train()
    diff = models.train_lm_side_by_side(model, opt, ref, ref_opt, rank=smp.rank(), world=smp.size())
    trace = model.live.trace or []
    gathers: dict[str, int] = {}
    for name, delta, _ in trace:
        gathers[name] = gathers.get(name, 0) + (delta > 0)
    return {
        "param": diff,
        "max_live": model.live.peak,
        "cap_plus_one_unit": layer + max(layer, root),
        "gathers": gathers,  # per unit, over the 2 steps
        "final_live": model.live.live,
    }


# GPT-NeoX 25M (bench_memory.py's "25m": hidden 512, 8 layers, vocab 1024 -- its embeddings are below
# the persistence threshold, so they stay whole in the root): the size the suite measures live.
NEOX_25M = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "intermediate_size": 2048}
NEOX_25M_VOCAB, NEOX_SEQ = 1024, 128


def estimate_live_case(sdp: int, *, steps: int = 2) -> dict[str, Any]:
    """Train NEOX_25M under delayed initialisation at `sdp` (AdamW, fp32, batch 1 x 128, bucket 5e7) and
    read this rank's RSS from outside: the RSS before the model is built (the estimator's framework
    term here: the pool's process, whatever earlier cases left in it) and the VmHWM from then on."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    _apply_mmap_threshold()
    smp.init({"sharded_data_parallel_degree": sdp, "sdp_reduce_bucket_size": int(5e7)})
    cfg = GPTNeoXConfig(
        vocab_size=NEOX_25M_VOCAB, max_position_embeddings=NEOX_SEQ, use_cache=False, tie_word_embeddings=False,
        hidden_dropout=0.0, attention_dropout=0.0, **NEOX_25M,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    start = Phase()
    with smp.delay_param_initialization():
        module = GPTNeoXForCausalLM(cfg)
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(smp.rank())
    for _ in range(steps):
        ids = torch.randint(0, NEOX_25M_VOCAB, (1, NEOX_SEQ), generator=g)
        model.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    peak = start.end()["peak"]
    del model, opt, module
    return {"baseline": start.base, "peak": start.base + peak}


def gloo_gather_temp_case(numel: int, chunk_bytes: int) -> dict[str, Any]:
    """One native (gloo) AllGather of `numel` fp32 elements per rank into an output already touched,
    with GLOO_GATHER_CHUNK_BYTES = chunk_bytes: the RSS peak above the RSS before the call, and whether
    every rank's block arrived bit for bit."""
    import torch.distributed as dist

    from shardpar.collectives import Group, NativeEngine
    from shardpar.collectives import native as native_engine

    _apply_mmap_threshold()
    rank, world = dist.get_rank(), dist.get_world_size()
    group = Group("world", tuple(range(world)), dist.group.WORLD)
    shard = torch.arange(numel, dtype=torch.float32) + rank * numel
    output = torch.full((world * numel,), -1.0)
    saved = native_engine.GLOO_GATHER_CHUNK_BYTES
    native_engine.GLOO_GATHER_CHUNK_BYTES = chunk_bytes
    try:
        phase = Phase()
        NativeEngine(timeout_s=60).all_gather(output, shard, group)
        peak = phase.end()["peak"]
    finally:
        native_engine.GLOO_GATHER_CHUNK_BYTES = saved
    exact = bool(torch.equal(output, torch.arange(world * numel, dtype=torch.float32)))
    return {"peak": peak, "exact": exact, "output_bytes": output.numel() * 4}


class _SmallParamBlock(nn.Module):
    def __init__(self, count: int, numel: int) -> None:
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(numel)) for _ in range(count))


class SmallParamNet(nn.Module):
    """128 MiB of fp32 in 64 KiB parameters: each below glibc's initial mmap threshold (128 KiB), so
    the full model lives in the heap, as a 563M GPT-NeoX's weights do once the threshold has risen."""

    def __init__(self, blocks: int = 16, count: int = 128, numel: int = 16384) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_SmallParamBlock(count, numel) for _ in range(blocks))


def wrap_release_case() -> dict[str, int]:
    """RSS (bytes above the RSS before the model was built) with the full model built, and after the
    wrap at sdp 2 has freed all but this rank's half ([Note: hand back what the wrap freed])."""
    smp.init({"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0})
    torch.manual_seed(0)
    # A pool worker's heap holds free pages from earlier cases, which the build would reuse without
    # growing the RSS: give them back first, so that the model's pages are new ones.
    ctypes.CDLL(None).malloc_trim(0)
    before = _status_kib("VmRSS") * 1024
    module = SmallParamNet()
    full = sum(p.numel() * p.element_size() for p in module.parameters())
    built = _status_kib("VmRSS") * 1024 - before
    model = smp.DistributedModel(module)
    kept = _status_kib("VmRSS") * 1024 - before
    shard = sum(p.local_piece.numel() * p.local_piece.element_size() for p in model.parameters())
    del model, module
    return {"full": full, "built": built, "kept": kept, "shard": shard}
