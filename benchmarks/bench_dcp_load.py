"""torch.distributed.checkpoint load time: an FSDP2 job's checkpoint loaded by shardpar vs by FSDP2 itself,
and shardpar's checkpoint loaded by FSDP2 (issue 32 item 5; target: shardpar <= 1.5 x FSDP2).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_dcp_load.py [--world 4] [--sdp 2] [--rounds 3] \\
        [--threshold 1000000] [--hidden 768 --layers 12 --vocab 50304]   # 168m-class GPT-NeoX (162 M)

One launch of `world` CPU ranks (gloo) holds both jobs of the same GPT-NeoX: FSDP2 (fully_shard per layer
and the root, world-way) and shardpar (sdp `sdp`), each with torch.optim.AdamW whose state is filled
as torch's get_optimizer_state_dict fills it. FSDP2 saves with dcp.save, shardpar too. A load is the
FSDP2 recipe, timed between barriers: get_state_dict, dcp.load, set_state_dict (model and optimizer).
Rounds interleave the loads, so a load change on a shared machine hits them alike; a load's time is
the slowest rank's.

What costs shardpar more than FSDP2 here: DCP's FileSystemReader deserializes a saved chunk whole for
every read request that overlaps it ("TODO sort by offset and cache the reading", torch
filesystem.py), so a rank's cost grows with its (chunk x saved chunk) overlaps, not only its bytes.
Parameters under `--threshold` are whole on every rank (persistent), but each rank describes only its
row block of them to DCP (runtime/dcp_chunks.py) and set_state_dict gathers the rest, so a rank reads
about as many saved blocks of them as an FSDP2 rank does (before: all of them, 2.7x FSDP2's reads at
sdp 4); at sdp 2 of world 4 each rank holds half the sharded model, twice an FSDP2 rank's quarter.
`--threshold 0 --sdp 4` is the like-for-like layout.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from typing import Any


def _rank(
    world: int, sdp: int, threshold: int, rounds: int, hidden: int, layers: int, vocab: int, root: str
) -> dict[str, Any]:
    import dcp_recipe
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    import shardpar as smp

    torch.set_num_threads(1)
    smp.init({"sharded_data_parallel_degree": sdp, "sdp_param_persistence_threshold": threshold})
    cfg = GPTNeoXConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
        intermediate_size=4 * hidden, max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    fsdp = GPTNeoXForCausalLM(cfg)
    params = sum(p.numel() for p in fsdp.parameters())
    mesh = init_device_mesh("cpu", (world,))
    for layer in fsdp.gpt_neox.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-4)
    torch.manual_seed(1)
    ours = smp.DistributedModel(GPTNeoXForCausalLM(cfg))
    ours_opt = smp.DistributedOptimizer(torch.optim.AdamW(ours.parameters(), lr=1e-4))

    dcp_recipe.save(fsdp, fsdp_opt, f"{root}/fsdp2")
    dcp_recipe.save(ours, ours_opt, f"{root}/shardpar")

    def load(model: Any, opt: Any, path: str) -> float:
        return dcp_recipe.timed(lambda: dcp_recipe.load(model, opt, path))

    out: dict[str, Any] = {"params": params, "fsdp2_own": [], "shardpar_from_fsdp2": [], "fsdp2_from_shardpar": []}
    for _ in range(rounds):
        out["fsdp2_from_shardpar"].append(load(fsdp, fsdp_opt, f"{root}/shardpar"))
        out["fsdp2_own"].append(load(fsdp, fsdp_opt, f"{root}/fsdp2"))
        out["shardpar_from_fsdp2"].append(load(ours, ours_opt, f"{root}/fsdp2"))
    # both now hold FSDP2's checkpoint (test_dcp.py checks bits; here a spot check that the loads happened)
    name = "gpt_neox.layers.0.mlp.dense_h_to_4h.weight"
    out["same"] = bool(torch.equal(dict(fsdp.named_parameters())[name].full_tensor(),
                                   dict(ours.named_parameters())[name].full_tensor()))  # fmt: skip
    smp.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--sdp", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threshold", type=int, default=1_000_000, help="sdp_param_persistence_threshold (0: as FSDP2)")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--dir", help="checkpoint directory (default: a temporary one, removed after)")
    a = p.parse_args()
    import dcp_recipe  # benchmarks/, on the path when run as a script

    from shardpar.cli.launcher import launch_local

    root = a.dir or tempfile.mkdtemp(prefix="bench_dcp_load_")
    try:
        args = (a.world, a.sdp, a.threshold, a.rounds, a.hidden, a.layers, a.vocab, root)
        res = launch_local(_rank, a.world, *args, timeout_s=3600)
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"GPT-NeoX {res[0]['params'] / 1e6:.1f} M parameters, fp32, world {a.world}, shardpar sdp {a.sdp}, "
        f"sdp_param_persistence_threshold {a.threshold}"
    )
    print(f"after the loads, FSDP2's and shardpar's parameters equal: {all(r['same'] for r in res)}")
    times = dcp_recipe.slowest_rank_times(res, a.rounds)
    base = statistics.median(times["fsdp2_own"])
    for key, each in times.items():
        med = statistics.median(each)
        rounds = ", ".join(f"{t:.2f}" for t in each)
        print(f"{key:22} median {med:7.2f} s  ({med / base:.2f} x FSDP2 loading its own)   rounds: {rounds} s")


if __name__ == "__main__":
    main()
