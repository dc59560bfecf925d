"""torch.distributed.checkpoint's save and load of a model and its optimizer as FSDP2's docs write them
(the state_dict API on both sides), timed the same way for every framework: shared by
bench_dcp_load.py and bench_dcp_owned.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def save(model: Any, opt: Any, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)  # fills an optimizer's empty state first, as a first save would
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def load(model: Any, opt: Any, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def timed(fn: Callable[[], Any]) -> float:
    """Seconds `fn` took between two barriers: the slowest rank's time once the caller takes the max."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def slowest_rank_times(results: list[dict[str, Any]], rounds: int) -> dict[str, list[float]]:
    """Per timed key (a rank's list of per-round seconds), the slowest rank's time of each round."""
    timed_keys = [k for k, v in results[0].items() if isinstance(v, list)]
    return {k: [max(r[k][i] for r in results) for i in range(rounds)] for k in timed_keys}
