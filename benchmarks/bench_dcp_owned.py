"""torch.distributed.checkpoint with an owner-stepped optimizer (issue 31; checkpoint/dcp_owned.py):
save and load time of Muon (hidden matrices, whole on owner ranks) + AdamW (the rest, pieces) against
AdamW on everything (pieces), the same GPT-NeoX, and the full optimizer state dict of each.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_dcp_owned.py [--world 4] [--sdp 2] [--rounds 3] \\
        [--hidden 256 --layers 4 --vocab 8192]

One launch of `world` CPU ranks (gloo) holds both jobs. A save is `get_state_dict` + `dcp.save`, a load
`get_state_dict` + `dcp.load` + `set_state_dict` (FSDP2's recipe), `full` is
`get_optimizer_state_dict(full_state_dict=True)`; each between barriers, the slowest rank's time; rounds
interleave the two optimizers, medians. Also the bytes each DCP checkpoint holds: owner-held state is
written once (both replicas' owners list it; DCP dedups), so Muon's checkpoint is smaller than AdamW's
by the second moment it does not keep.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any


def _rank(world: int, sdp: int, rounds: int, hidden: int, layers: int, vocab: int, root: str) -> dict[str, Any]:
    import dcp_recipe
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    import shardpar as smp

    torch.set_num_threads(1)
    smp.init({"sharded_data_parallel_degree": sdp, "sdp_param_persistence_threshold": 0})
    cfg = GPTNeoXConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
        intermediate_size=4 * hidden, max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip

    def hidden_matrix(name: str, p: Any) -> bool:
        return p.dim() == 2 and "embed" not in name and "lm_head" not in name  # torch.optim.Muon's recipe

    jobs: dict[str, tuple[Any, Any]] = {}
    for name in ("adamw", "muon"):
        torch.manual_seed(0)
        model = smp.DistributedModel(GPTNeoXForCausalLM(cfg))
        named = list(model.named_parameters())
        if name == "muon":
            muon = torch.optim.Muon([p for n, p in named if hidden_matrix(n, p)], lr=2e-2)
            inner: Any = [muon, torch.optim.AdamW([p for n, p in named if not hidden_matrix(n, p)], lr=1e-4)]
        else:
            inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
        opt = smp.DistributedOptimizer(inner, model=model)
        get_optimizer_state_dict(model, opt)  # fills the state (torch's lr-0 step), as a first save would
        jobs[name] = (model, opt)

    def save(name: str) -> None:
        dcp_recipe.save(*jobs[name], f"{root}/{name}")

    def load(name: str) -> None:
        dcp_recipe.load(*jobs[name], f"{root}/{name}")

    def full(name: str) -> None:
        get_optimizer_state_dict(*jobs[name], options=StateDictOptions(full_state_dict=True))

    out: dict[str, Any] = {"params": sum(p.numel() for p in GPTNeoXForCausalLM(cfg).parameters())}
    out["owned"] = len(jobs["muon"][1].owned_leaves())
    for _ in range(rounds):
        for name in jobs:
            for what, fn in (("save", save), ("load", load), ("full", full)):
                out.setdefault(f"{what} {name}", []).append(dcp_recipe.timed(lambda fn=fn, name=name: fn(name)))
    smp.shutdown()
    return out


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--sdp", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    a = p.parse_args()
    import dcp_recipe  # benchmarks/, on the path when run as a script

    from shardpar.cli.launcher import launch_local

    root = tempfile.mkdtemp(prefix="bench_dcp_owned_")
    try:
        args = (a.world, a.sdp, a.rounds, a.hidden, a.layers, a.vocab, root)
        res = launch_local(_rank, a.world, *args, timeout_s=3600)
        sizes = {n: _bytes(Path(root) / n) for n in ("adamw", "muon")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"GPT-NeoX {res[0]['params'] / 1e6:.2f} M parameters, fp32, world {a.world}, sdp {a.sdp}, every parameter "
        f"sharded; Muon steps {res[0]['owned']} matrices on owners; load average {os.getloadavg()[0]:.0f}"
    )
    print(f"DCP checkpoint bytes: adamw {sizes['adamw'] / 2**20:.1f} MiB, muon {sizes['muon'] / 2**20:.1f} MiB")
    times = dcp_recipe.slowest_rank_times(res, a.rounds)
    for what in ("save", "load", "full"):
        base = statistics.median(times[f"{what} adamw"])
        for name in ("adamw", "muon"):
            each = times[f"{what} {name}"]
            med = statistics.median(each)
            rounds = ", ".join(f"{t:.2f}" for t in each)
            print(f"{what} {name:6} median {med:6.2f} s ({med / base:.2f} x adamw)   rounds: {rounds} s")


if __name__ == "__main__":
    main()
