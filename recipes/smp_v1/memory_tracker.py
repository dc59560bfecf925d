"""Memory printouts of train_gpt_simple.py, from `smp.memory_metrics()` (this rank's CUDA allocator
figures, or VmRSS/VmHWM on CPU), on the ranks with rdp_rank 0 as v1 scripts printed them."""

from __future__ import annotations

import shardpar as smp  # v1: import smdistributed.modelparallel.torch as smp


def memory_status(msg: str = "") -> None:
    metrics = smp.memory_metrics(log=False)
    if smp.rdp_rank() == 0:
        figures = " ".join(f"{k} {v:0.1f}" for k, v in metrics.items())
        print(f"[{msg}] rank {smp.rank()} tp_rank {smp.tp_rank()} pp_rank {smp.pp_rank()} {figures} MiB")


def memory_status_cpu(msg: str = "") -> None:
    memory_status(msg)
