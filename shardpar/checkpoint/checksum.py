"""Per-tensor checksums of checkpoint payloads (no files here).

[Note: checkpoint checksums]
Every tensor a checkpoint file holds is hashed while `SafetensorsWriter` writes it (the bytes are
in cache then) and the result is recorded beside the file's table in our JSON: `index.json` for a
partial checkpoint, `shardpar_full.json` for a full one. Not in the safetensors `__metadata__`: the
header is written before the data (that is what lets a full export stream unit by unit), so a
checksum known only afterwards would need the header rewritten; and the Hugging Face files stay
exactly what `from_pretrained` and `safetensors` expect.

    "checksums": {"param/blocks.0.weight": "crc32:1c291ca3", ...}     one per tensor of the file

The value names its algorithm, so a reader meeting one it does not know says so instead of skipping
the check. CRC-32 (zlib) detects every burst error up to 32 bits and any odd number of flipped
bits; it is not a defence against tampering (a checkpoint is trusted input, and loading it never
executes code). It is the fastest hash in the standard library here (1.5-2.7 GB/s; adler32 no faster,
blake2b 5x slower), yet slower than a page-cache write + fsync (0.5-1 GB/s), so inline it adds to a
save. `Background` hashes on a worker thread while the same bytes are written and fsynced (zlib and
the write release the GIL), which hides it where a core is free; on the shared, overloaded 2-core
development machine it was not. Measurements: docs/checkpoints.md.

A load verifies before it writes anything: the tensors the load will read are shared among the
ranks (`share`, by bytes), each rank hashes its share, and the ranks agree on the outcome in the
check phase, so a mismatch raises the same CheckpointError on every rank and nothing is loaded.
That relies on every rank seeing the same files, which checkpoints already require. Checkpoints
written before checksums existed have no "checksums" and load unverified.
"""

from __future__ import annotations

import heapq
import zlib
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

ALGORITHM = "crc32"
_UPDATE: dict[str, Callable[[bytes | memoryview, int], int]] = {"crc32": zlib.crc32, "adler32": zlib.adler32}
_START = {"crc32": 0, "adler32": 1}


def start() -> int:
    return _START[ALGORITHM]


def update(value: int, data: bytes | memoryview) -> int:
    return _UPDATE[ALGORITHM](data, value)


def text(value: int, algorithm: str = ALGORITHM) -> str:
    return f"{algorithm}:{value:08x}"


def parse(recorded: object, *, where: str) -> str:
    """The algorithm of a recorded checksum; ValueError for a malformed or unknown one."""
    algorithm, _, digits = str(recorded).partition(":")
    if algorithm not in _UPDATE or len(digits) != 8:
        raise ValueError(
            f"{where}: checksum {recorded!r} is not '<algorithm>:<8 hex digits>' with an algorithm this shardpar "
            f"knows ({sorted(_UPDATE)}); the checkpoint was written by a newer shardpar, or its JSON is damaged"
        )
    return algorithm


def hasher(algorithm: str) -> tuple[int, Callable[[bytes | memoryview, int], int]]:
    """(initial value, update function) of `algorithm` (already checked by `parse`)."""
    return _START[algorithm], _UPDATE[algorithm]


def share(items: Iterable[tuple[str, str, int]], rank: int, world: int) -> list[tuple[str, str]]:
    """This rank's part of (file, key, nbytes) `items` to verify, balanced by bytes.

    The largest first, each to the least loaded rank (ties: the lower rank): every rank computes the
    same assignment from the same list, so every item is verified by exactly one rank.
    """
    loads = [(0, r) for r in range(world)]
    mine = []
    for file, key, nbytes in sorted(items, key=lambda it: (-it[2], it[0], it[1])):
        load, owner = heapq.heappop(loads)
        heapq.heappush(loads, (load + nbytes, owner))
        if owner == rank:
            mine.append((file, key))
    return sorted(mine)


_INLINE_BYTES = 1 << 20  # smaller tensors are hashed on the spot: a thread hand-off costs more
_MAX_PENDING_BYTES = 256 << 20  # bytes handed to the worker and not yet hashed (copies stay alive)


def _of(data: memoryview, keep: object) -> int:
    del keep  # held until hashed: `data` may be the buffer of a temporary CPU copy
    return update(start(), data)


class Background:
    """Checksums of tensors computed on one worker thread while the caller writes the same bytes.

    `add` the buffer *before* writing it; `finish` after the file's fsync, which the hashing of the
    last tensors overlaps too. At most _MAX_PENDING_BYTES (plus one tensor) are waited for at a time.
    [memory] a pending tensor keeps its storage alive until hashed; a full export `settle`s after each
    unit, so it still holds one unit's full parameters at a time. Nothing writes into a pending
    buffer: saves are synchronous and every gathered unit is a new tensor.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[tuple[str, Future[int] | int, int]] = deque()
        self._pending_bytes = 0
        self._done: dict[str, str] = {}

    def add(self, key: str, data: memoryview, keep: object) -> None:
        if len(data) < _INLINE_BYTES:
            self._pending.append((key, update(start(), data) if len(data) else start(), 0))
            return
        while self._pending and self._pending_bytes + len(data) > _MAX_PENDING_BYTES:
            self._settle_oldest()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardpar-checksum")
        self._pending.append((key, self._pool.submit(_of, data, keep), len(data)))
        self._pending_bytes += len(data)

    def _settle_oldest(self) -> None:
        key, value, nbytes = self._pending.popleft()
        self._done[key] = text(value if isinstance(value, int) else value.result())
        self._pending_bytes -= nbytes

    def settle(self) -> None:
        """Wait until everything added so far is hashed (its buffers may then be freed)."""
        while self._pending:
            self._settle_oldest()

    def finish(self) -> dict[str, str]:
        """key -> checksum text, in the order added."""
        self.settle()
        self.close()
        return self._done

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


# ---- combining CRC-32s of consecutive byte ranges (fingerprint.py) -------------------------------

_CRC32_POLY = 0xEDB88320  # zlib's, reflected


def _gf2_times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, row) for row in matrix]


def _byte_tables(matrix: list[int]) -> tuple[list[int], ...]:
    """`matrix` as four 256-entry tables, one per byte of the vector: a product is four look-ups."""
    tables = []
    for j in range(4):
        rows, table = matrix[8 * j : 8 * j + 8], [0] * 256
        for b in range(1, 256):  # linear: b's entry is its lowest bit's row XOR the entry of b without it
            low = (b & -b).bit_length() - 1
            table[b] = table[b & (b - 1)] ^ rows[low]
        tables.append(table)
    return tuple(tables)


# _ZEROS[k]: the operator that appends 2^k zero bytes to a CRC, as byte tables; grown on demand. Squaring
# a 32 x 32 bit matrix in Python is ~1000 operations: done once per k for the process, not once per bit
# of every length combined (an adapter-only save of GPT-NeoX 168m combines ~600 pieces: 0.43 s before).
_ZEROS: list[tuple[list[int], tuple[list[int], ...]]] = []


def _zeros_operator(k: int) -> tuple[list[int], ...]:
    if not _ZEROS:
        op = [_CRC32_POLY] + [1 << n for n in range(31)]  # the operator for one zero bit
        for _ in range(3):
            op = _gf2_square(op)  # ... for one zero byte
        _ZEROS.append((op, _byte_tables(op)))
    while len(_ZEROS) <= k:
        op = _gf2_square(_ZEROS[-1][0])
        _ZEROS.append((op, _byte_tables(op)))
    return _ZEROS[k][1]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A + B from crc32(A), crc32(B) and len(B) -- zlib's crc32_combine, which Python's zlib
    does not expose. Ranks hash their own pieces of a tensor and the pieces combine, in element order,
    into the CRC-32 of the whole tensor's bytes: the same value whatever sdp cut it (one product of a
    cached operator per set bit of len2, four table look-ups each)."""
    k = 0
    while len2 > 0:  # apply len2 zero bytes to crc1: the operator for 2^k bytes where bit k of len2 is set
        if len2 & 1:
            t0, t1, t2, t3 = _zeros_operator(k)
            crc1 = t0[crc1 & 0xFF] ^ t1[(crc1 >> 8) & 0xFF] ^ t2[(crc1 >> 16) & 0xFF] ^ t3[crc1 >> 24]
        len2 >>= 1
        k += 1
    return crc1 ^ crc2
