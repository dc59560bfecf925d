"""Issue 32 item 5: torch.distributed.checkpoint both ways. An FSDP2 job's DCP checkpoint (world 2) loads
into shardpar at world 4, sdp 2 bit for bit, and the next step matches FSDP2's; shardpar's DCP
checkpoint loads into FSDP2 likewise; so do both through `shardpar convert` (FSDP2's DCP -> shardpar's
format -> a shardpar resume; shardpar's format -> DCP -> FSDP2). The cases say why the comparisons are exact."""

from __future__ import annotations

from pathlib import Path

from shardpar.cli.main import main
from tests.multiproc import dcp_cases as cases
from tests.multiproc.fsdp2_cases import _same


def _clean(res: dict, keys: tuple[str, ...], who: str) -> None:
    for key in keys:
        assert res[key] == [], f"{who} {key}: {res[key][:3]}"


def test_fsdp2_checkpoint_into_shardpar_and_back(ranks, tmp_path: Path) -> None:
    fsdp2_dir, ours_dir = str(tmp_path / "fsdp2"), str(tmp_path / "shardpar")
    converted, native, native_dcp = (str(tmp_path / n) for n in ("converted", "native", "native_dcp"))
    ref = ranks.run(2, cases.fsdp2_save_case, fsdp2_dir, timeout=300)[0]
    assert ref["placements"] == ["(Shard(dim=0),)"], ref["placements"]
    assert main(["convert", fsdp2_dir, converted, "--to", "shardpar", "--optimizer-class", "AdamW"]) == 0
    args = (fsdp2_dir, ours_dir, converted, native, ref["saved"], ref["next"], 2)
    got = ranks.run(4, cases.shardpar_from_fsdp2_case, *args, timeout=300)
    for rank, res in enumerate(got):
        assert res["types"] == ["ShardedTensor"] and res["optim_types"] == ["ShardedTensor", "Tensor"], res
        _clean(res, ("converted", "loaded", "stepped"), f"shardpar rank {rank}")
    # shard_optimizer_state: the optimizer pieces split over the replicas too; the same bits, the same step
    args = (fsdp2_dir, str(tmp_path / "soc"), converted, str(tmp_path / "soc_native"), ref["saved"], ref["next"], 2)
    soc = ranks.run(4, cases.shardpar_from_fsdp2_case, *args, shard_optimizer_state=True, timeout=300)
    for rank, res in enumerate(soc):
        _clean(res, ("converted", "loaded", "stepped"), f"shard_optimizer_state rank {rank}")
        assert _same(res["next"], got[rank]["next"]) == [], f"shard_optimizer_state rank {rank}: another 4th step"
    assert main(["convert", native, native_dcp, "--to", "dcp"]) == 0
    back = ranks.run(2, cases.fsdp2_from_shardpar_case, ours_dir, native_dcp, ref["next"], got[0]["next"], timeout=300)
    for rank, res in enumerate(back):
        _clean(res, ("converted", "loaded", "stepped"), f"FSDP2 rank {rank}")


def test_sharded_state_dict_aliases_and_loads_in_place(ranks) -> None:
    for res in ranks.run(2, cases.sharded_state_dict_case, timeout=120):
        assert res["alias"] is True
        assert res["full_tensor"] == [] and res["set"] == [], res
        assert "bogus" in res["unexpected"] and "strict=False" in res["unexpected"], res["unexpected"]


def test_persistent_tensors_are_read_as_row_blocks_and_gathered(ranks, tmp_path: Path) -> None:
    """A persistent parameter is whole on every rank; DCP reads each rank's row block of it only
    (runtime/dcp_chunks.py), set_state_dict gathers the rest (checkpoint/dcp_persistent.py)."""
    got = ranks.run(4, cases.persistent_rows_case, str(tmp_path / "ckpt"), timeout=120)
    blocks = [(0, 4), (4, 4), (8, 4), (12, 1)]  # torch.chunk of 13 rows in 4
    for rank, res in enumerate(got):
        assert res["chunks"] == [([blocks[rank][0], 0], [blocks[rank][1], 7])], (rank, res["chunks"])
        assert res["own_rows_loaded"] and res["other_rows_untouched"], (rank, res)
        _clean(res, ("loaded", "stepped"), f"rank {rank}")
