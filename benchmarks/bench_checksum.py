"""What the per-tensor checksums cost ([Note: checkpoint checksums] in shardpar/checkpoint/checksum.py).

One process writes ~500 MB of fp32 tensors (64 tensors of 2M elements: transformer-layer sized)
through `SafetensorsWriter` (the writer every checkpoint file goes through; fsync included) without
a hash, with the hash inline, and with the shipped background hashing, alternating round by round,
and reads them back (safe_open, get_tensor + a copy), with and without `verify_tensors` first. Also
the raw throughput of the candidate hashes over the same 500 MB, from memory. Medians of --rounds
rounds. CPU-bound work stretches with the machine's load (printed first): compare within one run.

    .venv/bin/python benchmarks/bench_checksum.py                  # 500 MB in a temporary directory
    .venv/bin/python benchmarks/bench_checksum.py --dir /path/on/the/checkpoint/disk --rounds 7
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from shardpar.checkpoint import checksum
from shardpar.checkpoint.safetensors_io import verify_tensors, write_tensors


def _timed(fn: Callable[[], object], cpu: list[float] | None = None) -> float:
    """Wall seconds of fn(); its CPU seconds (every thread of this process) appended to `cpu`."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    return time.perf_counter() - t0


def _read_all(path: Path) -> None:
    with safe_open(path, framework="pt") as f:
        for k in f.keys():  # noqa: SIM118 -- safe_open has no __iter__
            f.get_tensor(k).clone()  # a resume copies every byte it reads into the model


def _verify_then_read(path: Path, sums: dict[str, str]) -> None:
    verify_tensors(path, label=str(path), expected=sums)
    _read_all(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    numel = 2 * 1024 * 1024
    count = max(1, args.mb * 1_000_000 // (numel * 4))
    tensors = {f"param/layers.{i}.weight": torch.randn(numel) for i in range(count)}
    total = sum(t.numel() * 4 for t in tensors.values())
    print(f"{count} fp32 tensors, {total / 1e6:.0f} MB, torch {torch.__version__}, zlib {zlib.ZLIB_RUNTIME_VERSION}")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")

    raw = [t.view(torch.uint8).numpy().data for t in tensors.values()]
    hashes: dict[str, Callable[[], object]] = {
        "zlib.crc32": lambda: [zlib.crc32(b) for b in raw],
        "zlib.adler32": lambda: [zlib.adler32(b) for b in raw],
        "blake2b": lambda: [hashlib.blake2b(b).digest() for b in raw],
    }
    for name, fn in hashes.items():
        t = statistics.median(_timed(fn) for _ in range(args.rounds))
        print(f"  {name:13s} {total / t / 1e6:8.0f} MB/s from memory")

    real_update, real_inline = checksum.update, checksum._INLINE_BYTES
    modes = {  # (hash on?, smallest tensor handed to the worker thread)
        "no hash": (False, real_inline),
        "crc32 inline": (True, 1 << 62),
        "crc32 background (shipped)": (True, real_inline),
    }
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = Path(d) / "shard-00000.safetensors"
        save: dict[str, list[float]] = {m: [] for m in modes}
        cpu: dict[str, list[float]] = {m: [] for m in modes}
        load: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for mode, (hashed, inline) in modes.items():
                checksum.update = real_update if hashed else (lambda value, data: value)
                checksum._INLINE_BYTES = inline
                save[mode].append(_timed(lambda: write_tensors(path, tensors, {"format": "pt"}), cpu[mode]))
            checksum.update, checksum._INLINE_BYTES = real_update, real_inline
            sums = write_tensors(path, tensors, {"format": "pt"}).checksums
            load[False].append(_timed(lambda: _read_all(path)))
            load[True].append(_timed(functools.partial(_verify_then_read, path, sums)))
        base = statistics.median(save["no hash"])
        for mode in modes:
            t = statistics.median(save[mode])
            print(
                f"  save, {mode:27s} {t:.3f} s ({(t / base - 1) * 100:+5.1f}%, {total / t / 1e6:4.0f} MB/s), "
                f"CPU {statistics.median(cpu[mode]):.3f} s"
            )
        off, on = statistics.median(load[False]), statistics.median(load[True])
        print(
            f"  load (read + copy): {off:.3f} s without, {on:.3f} s with verify_tensors first "
            f"({(on / off - 1) * 100:+.1f}%; {total / off / 1e6:.0f} -> {total / on / 1e6:.0f} MB/s)"
        )


if __name__ == "__main__":
    main()
