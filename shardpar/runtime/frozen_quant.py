"""Block quantization of a frozen shard: `sdp_frozen_base_mode` "int8" and "nf4" (issue 33 item 2).

[Note: quantized frozen base]
A frozen weight never changes, so it can be stored and AllGathered quantized once and dequantized into
the compute dtype at each use (DeepSpeed's MixZ++ for int8, QLoRA's NF4 for 4 bits). Each rank
quantizes its own shard in blocks of QBLOCK = 64 consecutive values (QLoRA's block), each block with
one fp32 scale, its absmax; everything a rank sends is one uint8 tensor, codes then scales:

    int8:  code = round(x / absmax * 127)              64 B of codes + 4 B of scale per block: 1.0625 B/value
    nf4:   code = nearest of NF4's 16 levels to x / absmax, two codes a byte (low nibble first):
                                                       32 B of codes + 4 B of scale per block: 0.5625 B/value

against 2 B/value for a bf16 base and 4 for fp32. A shard's blocks start at its first value, so a
gathered [sdp, bytes] tensor dequantizes row by row, with no block straddling two ranks. The scales
stay fp32 (QLoRA's "double quantization" of the scales to 8 bits is not done: 1/16 B a value more).
Every rank -- the shard's owner too -- computes with the dequantized values, so all ranks hold the same
weights. The exact shard in the parameters' dtype is dropped once quantized: a rank stores the codes
and scales only ([Note: quantized base keeps no exact shard] in frozen_exact.py, which says what state
dicts, checkpoints and fingerprints see instead).

Error (absmax scaling): int8 is within absmax/254 of its block per value; NF4's levels are spaced for
normally distributed weights, its largest gap (-1 to -0.696) bounds the error at 0.152 x absmax.
`relative_errors` measures it per tensor at wrap (model.py logs it on rank 0).
"""

from __future__ import annotations

import torch

QBLOCK = 64
MODES = ("gather", "keep_gathered", "int8", "nf4")
QUANTIZED = ("int8", "nf4")

# QLoRA's NormalFloat-4 code book (Dettmers et al. 2023, appendix E; bitsandbytes' NF4 table).
NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


def num_blocks(numel: int) -> int:
    return -(-numel // QBLOCK)


def code_bytes(mode: str, numel: int) -> int:
    """Bytes of codes for `numel` values (whole blocks): a multiple of 32, so the scales after them align."""
    per_block = QBLOCK if mode == "int8" else QBLOCK // 2
    return num_blocks(numel) * per_block


def packed_bytes(mode: str, numel: int) -> int:
    """Bytes one rank's quantized shard of `numel` values takes: codes, then an fp32 scale per block."""
    return code_bytes(mode, numel) + 4 * num_blocks(numel)


def quantize(x: torch.Tensor, mode: str) -> torch.Tensor:
    """A flat shard -> its packed uint8 form (codes, then scales), computed in fp32."""
    if mode not in QUANTIZED:
        raise ValueError(f"quantize: mode {mode!r} is not one of {QUANTIZED}")
    n = x.numel()
    blocks = torch.zeros(num_blocks(n) * QBLOCK, dtype=torch.float32, device=x.device)
    blocks[:n] = x.reshape(-1)
    blocks = blocks.view(-1, QBLOCK)
    absmax = blocks.abs().amax(dim=1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax)).unsqueeze(1)
    out = torch.empty(packed_bytes(mode, n), dtype=torch.uint8, device=x.device)
    codes = out[: code_bytes(mode, n)]
    if mode == "int8":
        q = torch.round(blocks / safe * 127.0).clamp_(-127, 127).to(torch.int8)
        codes.copy_(q.view(-1).view(torch.uint8))
    else:
        levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=x.device)
        # nearest level: bucketize on the midpoints between neighbours
        idx = torch.bucketize((blocks / safe).reshape(-1), (levels[1:] + levels[:-1]) / 2).to(torch.uint8)
        pairs = idx.view(-1, 2)
        codes.copy_(pairs[:, 0] | (pairs[:, 1] << 4))
    out[code_bytes(mode, n) :].view(torch.float32).copy_(absmax)
    return out


# Blocks dequantized at a time: the fp32 (and for nf4 int32 index) temporaries stay at a few MiB instead
# of a unit's worth beside its gathered buffer -- they were 117 MiB of peak RSS a rank at 168m.
CHUNK_BLOCKS = 1 << 14


def fits_in_place(mode: str, numel: int, out_dtype: torch.dtype) -> bool:
    """Whether a row's packed bytes fit in the bytes its `numel` dequantized values take, so a gather
    can land in the front of the output buffer ([Note: dequantizing in place])."""
    return packed_bytes(mode, numel) <= numel * out_dtype.itemsize


# [Note: dequantizing in place]
# A quantized unit's gather can land in the front of its compute-dtype buffer instead of a buffer of
# its own: a separate uint8 buffer per gather (13 MB a 563M layer under int8) beside the 25 MB bf16
# one fragmented glibc's heap so that int8 peaked 0.5 GiB above the bf16 base at 563m. The rows are
# then dequantized from the last row to the first and, in a row, from its last chunk to its first,
# with the row's scales copied out before any of its values is written. Row r's values go to bytes
# [r n e, (r+1) n e) (n values a row, e bytes a value) and its packed bytes sit at [r P, (r+1) P):
# with P <= n e (fits_in_place) every write lands at or above the bytes still unread -- the earlier
# rows' packed bytes end at r P <= r n e, and in row r the codes of values [0, x) end at
# r P + x pb <= r n e + x e (pb <= e bytes of code a value) -- and each chunk reads its codes into a
# temporary before writing. The same order is exact when packed and out do not overlap.


def dequantize_into(out: torch.Tensor, packed: torch.Tensor, mode: str, numel: int) -> None:
    """Rows of packed shards ([rows, packed_bytes] uint8, one a rank) -> `out`, flat, rows * numel values
    in its dtype: row r's `numel` values at [r * numel, (r + 1) * numel). `packed` may be the front of
    `out`'s own bytes ([Note: dequantizing in place])."""
    rows = packed.shape[0]
    nblocks, cb = num_blocks(numel), code_bytes(mode, numel)
    per_block = QBLOCK if mode == "int8" else QBLOCK // 2
    target = out.view(rows, numel)
    pairs = _nf4_byte_table(packed.device) if mode == "nf4" else None
    starts = range(0, nblocks, CHUNK_BLOCKS)
    for r in reversed(range(rows)):
        row_scales = packed[r, cb : cb + 4 * nblocks].clone().view(torch.float32)  # before row r is written
        for lo in reversed(starts):
            n = min(CHUNK_BLOCKS, nblocks - lo)
            scales = row_scales[lo : lo + n].view(n, 1)
            codes = packed[r, per_block * lo : per_block * (lo + n)]
            if pairs is None:
                values = codes.view(torch.int8).view(n, QBLOCK).to(torch.float32).mul_(scales / 127.0)
            else:  # one look-up a byte gives its two values, low nibble first
                values = pairs.index_select(0, codes.int()).view(n, QBLOCK).mul_(scales)
            end = min(numel, (lo + n) * QBLOCK)
            target[r, lo * QBLOCK : end].copy_(values.view(-1)[: end - lo * QBLOCK])


def _nf4_byte_table(device: torch.device) -> torch.Tensor:
    """[256, 2] fp32: byte b's two NF4 values (low nibble, high nibble). Looking a byte up once with
    int32 indices instead of each nibble with int64 ones: 2-3x faster at a 1M-value chunk (4.9-5.8 ->
    1.7-2.6 ms, one thread) and 4 MiB of index temporaries a chunk instead of 9."""
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)
    return torch.stack((levels.repeat(16), levels.repeat_interleave(16)), dim=-1)


def dequantize(packed: torch.Tensor, mode: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """One packed shard -> its `numel` values in `dtype`."""
    out = torch.empty(numel, dtype=dtype, device=packed.device)
    dequantize_into(out, packed.view(1, -1), mode, numel)
    return out


def relative_errors(exact: torch.Tensor, approx: torch.Tensor) -> tuple[float, float]:
    """(max |err| / max |w|, mean |err| / mean |w|) of one tensor; (0, 0) for an all-zero or empty one."""
    if exact.numel() == 0:
        return 0.0, 0.0
    x, err = exact.float(), (approx.float() - exact.float()).abs()
    top, mean = x.abs().max().item(), x.abs().mean().item()
    return (err.max().item() / top if top else 0.0), (err.mean().item() / mean if mean else 0.0)
