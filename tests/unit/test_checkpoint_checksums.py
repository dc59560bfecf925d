"""Checkpoint payload checksums (issue 24, item 2; [Note: checkpoint checksums] in
shardpar/checkpoint/checksum.py): 64 flipped bytes of tensor data, header untouched, are refused
naming the file and the tensor, and nothing is loaded; checkpoints without checksums still load.

Real files, a world of one through the facade; tests/multiproc/test_checkpoint.py runs the same
damage on two ranks (every rank raises).
"""

from __future__ import annotations

import itertools
import json
import struct
import zlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import shardpar as smp
from shardpar.checkpoint import CheckpointError, checksum, load_consolidated
from shardpar.checkpoint.safetensors_io import verify_tensors, write_tensors
from tests import models

# ---- helpers -------------------------------------------------------------------------------------


def _header(path: Path) -> tuple[int, dict[str, dict[str, object]]]:
    """The safetensors header, parsed here by hand (not by the code under test)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n])


def _largest(path: Path, prefix: str) -> str:
    _, header = _header(path)
    sizes = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k.startswith(prefix)}  # type: ignore[index]
    return max(sizes, key=lambda k: sizes[k])


def _flip(path: Path, key: str, num_bytes: int = 64) -> None:
    """Invert `num_bytes` bytes in the middle of tensor `key`'s data; the header stays byte-identical."""
    n, header = _header(path)
    begin, end = header[key]["data_offsets"]  # type: ignore[misc]
    if end - begin < num_bytes:
        raise AssertionError(f"{key} has {end - begin} bytes, fewer than {num_bytes}")
    data = bytearray(path.read_bytes())
    head = bytes(data[: 8 + n])
    at = 8 + n + begin + (end - begin - num_bytes) // 2
    data[at : at + num_bytes] = bytes(b ^ 0xFF for b in data[at : at + num_bytes])
    path.write_bytes(data)
    assert path.read_bytes()[: 8 + n] == head


def _strip_checksums(manifest: Path) -> None:
    """Make a checkpoint look like one written before checksums existed."""
    info = json.loads(manifest.read_text())
    for entry in info["files"].values():
        del entry["checksums"]
    manifest.write_text(json.dumps(info))


# ---- checksums -----------------------------------------------------------------------------------


def test_a_flipped_tensor_payload_is_refused_naming_file_and_tensor_and_loads_nothing(
    world_of_one: None, tmp_path: Path
) -> None:
    model, opt = models.adamw_mlp(seed=0)
    models.train_mlp(model, opt, range(2))
    smp.save_checkpoint(tmp_path, "good", model=model, optimizer=opt)
    shard = tmp_path / "good_partial" / "shard-00000.safetensors"
    key = _largest(shard, "param/")
    _flip(shard, key)

    fresh, fresh_opt = models.adamw_mlp(seed=7)
    before = models.model_and_optimizer_state(fresh, fresh_opt)
    with pytest.raises(CheckpointError, match=rf"shard-00000\.safetensors: tensor '{key}': checksum mismatch"):
        smp.resume_from_checkpoint(tmp_path, "good")
    assert models.same_tensors(models.model_and_optimizer_state(fresh, fresh_opt), before), (
        "a refused resume changed the model or the optimizer"
    )
    with pytest.raises(CheckpointError, match=rf"tensor '{key}': checksum mismatch"):
        dict(load_consolidated(tmp_path, "good"))


def test_corrupt_optimizer_state_is_caught_and_skipped_when_not_loaded(world_of_one: None, tmp_path: Path) -> None:
    model, opt = models.adamw_mlp(seed=0)
    models.train_mlp(model, opt, range(2))
    smp.save_checkpoint(tmp_path, "good", model=model, optimizer=opt)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    shard = tmp_path / "good_partial" / "shard-00000.safetensors"
    key = _largest(shard, "optim/exp_avg_sq/")
    _flip(shard, key)

    fresh, _ = models.adamw_mlp(seed=7)
    with pytest.raises(CheckpointError, match=rf"tensor '{key}': checksum mismatch"):
        smp.resume_from_checkpoint(tmp_path, "good")
    smp.resume_from_checkpoint(tmp_path, "good", load_optimizer=False)  # the damaged tensor is not read
    assert models.same_tensors({k: v.clone() for k, v in fresh.state_dict().items()}, saved)


def test_a_flipped_full_checkpoint_is_refused_and_the_export_stays_plain_safetensors(
    world_of_one: None, tmp_path: Path
) -> None:
    model, opt = models.adamw_mlp(seed=0)
    models.train_mlp(model, opt, range(2))
    smp.save_checkpoint(tmp_path, "full", model=model, partial=False)
    weights = tmp_path / "full" / "model.safetensors"
    manifest = json.loads((tmp_path / "full" / "shardpar_full.json").read_text())
    with safe_open(weights, framework="pt") as f:  # the checksums live in our manifest, not in the file
        assert f.metadata() == {"format": "pt", "checkpoint_id": manifest["checkpoint_id"]}
        assert set(manifest["files"]["model.safetensors"]["checksums"]) == set(f.keys())
    key = _largest(weights, "blocks.")
    _flip(weights, key)

    fresh, fresh_opt = models.adamw_mlp(seed=7)
    before = models.model_and_optimizer_state(fresh, fresh_opt)
    with pytest.raises(CheckpointError, match=rf"full/model\.safetensors: tensor '{key}': checksum mismatch"):
        smp.resume_from_checkpoint(tmp_path, "full", partial=False)
    assert models.same_tensors(models.model_and_optimizer_state(fresh, fresh_opt), before), (
        "a refused resume changed the model"
    )


def test_checkpoints_written_before_checksums_still_load(world_of_one: None, tmp_path: Path) -> None:
    model, opt = models.adamw_mlp(seed=0)
    models.train_mlp(model, opt, range(2))
    smp.save_checkpoint(tmp_path, "old", model=model, optimizer=opt)
    smp.save_checkpoint(tmp_path, "oldfull", model=model, partial=False)
    saved = models.model_and_optimizer_state(model, opt)
    _strip_checksums(tmp_path / "old_partial" / "index.json")
    _strip_checksums(tmp_path / "oldfull" / "shardpar_full.json")

    fresh, fresh_opt = models.adamw_mlp(seed=7)
    smp.resume_from_checkpoint(tmp_path, "old")
    assert models.same_tensors(models.model_and_optimizer_state(fresh, fresh_opt), saved)
    other, _ = models.adamw_mlp(seed=8)
    smp.resume_from_checkpoint(tmp_path, "oldfull", partial=False)
    assert models.same_tensors(
        {k: v.clone() for k, v in other.state_dict().items()}, {k: saved[k] for k in model.state_dict()}
    )


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda sums, key: sums.pop(key), "checksums and tensors disagree about 1 keys"),
        (lambda sums, key: sums.__setitem__(key, "sha9:00000000"), "written by a newer shardpar"),
    ],
)
def test_a_damaged_checksum_table_is_refused(world_of_one: None, tmp_path: Path, damage: object, words: str) -> None:
    model, opt = models.adamw_mlp(seed=0)
    smp.save_checkpoint(tmp_path, "t", model=model, optimizer=opt)
    path = tmp_path / "t_partial" / "index.json"
    index = json.loads(path.read_text())
    sums = index["files"]["shard-00000.safetensors"]["checksums"]
    damage(sums, sorted(sums)[0])  # type: ignore[operator]
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=words):
        smp.resume_from_checkpoint(tmp_path, "t")


def test_verification_is_shared_so_every_tensor_is_hashed_by_exactly_one_rank() -> None:
    items = [("a", f"k{i}", size) for i, size in enumerate([900, 10, 10, 400, 400, 300, 0, 5])]
    shares = [checksum.share(items, rank, 3) for rank in range(3)]
    assert sorted(x for s in shares for x in s) == sorted((f, k) for f, k, _ in items)
    loads = [sum(n for f, k, n in items if (f, k) in s) for s in shares]
    assert max(loads) == 900 and sorted(loads) == [425, 700, 900], loads


def test_large_tensors_are_hashed_on_the_worker_thread_exactly_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensors of 1 MiB and more go to checksum.Background's thread, a few MiB outstanding at most here."""
    monkeypatch.setattr(checksum, "_MAX_PENDING_BYTES", 3 << 20)
    torch.manual_seed(0)
    tensors = {f"param/w{i}": torch.randn(n) for i, n in enumerate([300_000, 5, 700_000, 0, 400_000, 262_144])}
    tensors["param/bf16"] = torch.randn(600_000).to(torch.bfloat16)
    path = tmp_path / "big.safetensors"
    sums = write_tensors(path, tensors, {"format": "pt"}).checksums
    assert list(sums) == list(tensors)  # in write order
    for key, t in tensors.items():
        assert sums[key] == f"crc32:{zlib.crc32(t.view(torch.uint8).numpy().tobytes()):08x}", key
    verify_tensors(path, label=str(path), expected=sums)
    _flip(path, "param/w2")
    with pytest.raises(CheckpointError, match=r"big\.safetensors: tensor 'param/w2': checksum mismatch"):
        verify_tensors(path, label=str(path), expected=sums)


@pytest.mark.parametrize("partial", [True, False])
def test_checkpoints_with_megabyte_tensors_round_trip_through_the_worker_thread(
    world_of_one: None, tmp_path: Path, partial: bool
) -> None:
    """inp.weight is 600 x 600 fp32 (1.4 MB): hashed on checksum.Background's thread, in both writers."""
    torch.manual_seed(0)
    model = smp.DistributedModel(models.UnevenMLP(width=600))
    smp.save_checkpoint(tmp_path, "big", model=model, partial=partial)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    fresh = smp.DistributedModel(models.UnevenMLP(width=600))
    smp.resume_from_checkpoint(tmp_path, "big", partial=partial)
    assert models.same_tensors({k: v.clone() for k, v in fresh.state_dict().items()}, saved)
    weights = tmp_path / ("big_partial/shard-00000.safetensors" if partial else "big/model.safetensors")
    key = "param/inp.weight" if partial else "inp.weight"
    _flip(weights, key)
    with pytest.raises(CheckpointError, match=rf"tensor '{key}': checksum mismatch"):
        smp.resume_from_checkpoint(tmp_path, "big", partial=partial)


def test_crc32_combine_is_the_crc_of_the_concatenation() -> None:
    """fingerprint.py combines ranks' piece CRCs into the whole tensor's: zlib's crc32_combine."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (70_001,), dtype=torch.uint8, generator=g).numpy().tobytes()
    for cuts in ([0], [1], [35_000], [3, 4, 69_999], [10, 1000, 20_000, 50_000]):
        bounds = [0, *cuts, len(data)]
        value = checksum.start()
        for lo, hi in itertools.pairwise(bounds):
            value = checksum.crc32_combine(value, zlib.crc32(data[lo:hi]), hi - lo)
        assert value == zlib.crc32(data), cuts


def test_crc32_combine_long_lengths() -> None:
    """The cached zero-byte operators (2^k bytes, one per bit of the length) up to 2^40 bytes: pieces of a
    4 MiB buffer against zlib, and 40-bit lengths against appending zeros by the operator squared per bit
    (the straightforward form the cache replaces, itself checked against zlib on short zero runs)."""
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, ((1 << 22) + 3,), dtype=torch.uint8, generator=g).numpy().tobytes()
    bounds = [0, 5, (1 << 21) + 7, (1 << 22) - 1, len(data)]
    value = checksum.start()
    for lo, hi in itertools.pairwise(bounds):
        value = checksum.crc32_combine(value, zlib.crc32(data[lo:hi]), hi - lo)
    assert value == zlib.crc32(data)

    def append_zeros(crc: int, n: int) -> int:  # zlib's definition, one 32 x 32 product per set bit of n
        op = [0xEDB88320] + [1 << i for i in range(31)]
        for _ in range(3):
            op = [_times(op, row) for row in op]
        while n:
            if n & 1:
                crc = _times(op, crc)
            n >>= 1
            op = [_times(op, row) for row in op]
        return crc

    assert append_zeros(0x12345678, 1000) == zlib.crc32(bytes(1000), 0x12345678) ^ zlib.crc32(bytes(1000))
    for n in (1, 255, 256, (1 << 32) + 1, (1 << 40) - 3, 0x5A5A5A5A5A):
        assert checksum.crc32_combine(0xDEADBEEF, 0x0BADF00D, n) == append_zeros(0xDEADBEEF, n) ^ 0x0BADF00D, n


def _times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out
