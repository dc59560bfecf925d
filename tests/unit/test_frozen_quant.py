"""Block quantization of a frozen base (runtime/frozen_quant.py), the sdp_frozen_base_mode knob, and the
refusal of bitsandbytes-quantized parameters (issue 33 item 2)."""

from __future__ import annotations

import zlib

import pytest
import torch
from torch import nn

from shardpar.config import Config
from shardpar.runtime import frozen_quant as fq
from shardpar.runtime.frozen_modes import refuse_bitsandbytes


def _weights(n: int = 1000) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * 0.02
    x[5] = 0.3  # an outlier: its block's scale is set by it
    x[640:704] = 0.0  # an all-zero block
    return x


def test_int8_layout_and_error_bound() -> None:
    x = _weights()
    packed = fq.quantize(x, "int8")
    assert packed.dtype == torch.uint8 and packed.numel() == 16 * 64 + 16 * 4  # 1000 values: 16 blocks
    y = fq.dequantize(packed, "int8", 1000, torch.float32)
    blocks = torch.nn.functional.pad(x, (0, 24)).view(-1, 64)
    bound = (blocks.abs().amax(dim=1, keepdim=True) / 254).expand(-1, 64).reshape(-1)[:1000]
    assert ((y - x).abs() <= bound * 1.0001 + 1e-12).all()  # half a step of its block
    assert (y[640:704] == 0).all() and y[5] == x[5]  # the absmax itself is exact


def test_nf4_layout_levels_and_error_bound() -> None:
    x = _weights()
    packed = fq.quantize(x, "nf4")
    assert packed.numel() == 16 * 32 + 16 * 4  # two codes a byte
    y = fq.dequantize(packed, "nf4", 1000, torch.float32)
    blocks = torch.nn.functional.pad(x, (0, 24)).view(-1, 64)
    absmax = blocks.abs().amax(dim=1, keepdim=True).expand(-1, 64).reshape(-1)[:1000]
    assert ((y - x).abs() <= absmax * (1 - 0.6961928009986877) / 2 * 1.0001).all()  # the widest gap's half
    levels = torch.tensor(fq.NF4_LEVELS)
    exact = levels.repeat(4) * 0.5  # one block holding every level: they come back exactly
    assert torch.equal(fq.dequantize(fq.quantize(exact, "nf4"), "nf4", 64, torch.float32), exact)


def test_rows_dequantize_each_ranks_shard_on_its_own() -> None:
    a, b = _weights(100), _weights(100) * 3
    for mode in fq.QUANTIZED:
        rows = torch.stack([fq.quantize(a, mode), fq.quantize(b, mode)])
        out = torch.empty(200, dtype=torch.bfloat16)
        fq.dequantize_into(out, rows, mode, 100)
        assert torch.equal(out[:100], fq.dequantize(rows[0], mode, 100, torch.bfloat16))
        assert torch.equal(out[100:], fq.dequantize(rows[1], mode, 100, torch.bfloat16))


def test_relative_errors() -> None:
    x = torch.tensor([1.0, -2.0, 0.0, 1.0])
    assert fq.relative_errors(x, x + torch.tensor([0.0, 0.2, 0.0, 0.0])) == pytest.approx((0.1, 0.05 / 1.0))
    assert fq.relative_errors(torch.zeros(3), torch.zeros(3)) == (0.0, 0.0)


def test_knob_default_and_bad_value() -> None:
    assert Config().sdp_frozen_base_mode == "gather"
    assert Config.from_any({"sdp_frozen_base_mode": "nf4"}).sdp_frozen_base_mode == "nf4"
    with pytest.raises(ValueError, match=r"sdp_frozen_base_mode='int4' is not one of .*'nf4'"):
        Config.from_any({"sdp_frozen_base_mode": "int4"})


class Params4bit(nn.Parameter):  # bitsandbytes' class name: the refusal goes by name, bnb is not needed
    pass


def test_bitsandbytes_parameters_are_refused_naming_the_knob() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    model[0].weight = Params4bit(torch.zeros(4, 4), requires_grad=False)
    with pytest.raises(ValueError, match=r"0\.weight is a bitsandbytes Params4bit.*sdp_frozen_base_mode='nf4'"):
        refuse_bitsandbytes(model)
    refuse_bitsandbytes(nn.Sequential(nn.Linear(4, 4)))  # plain parameters pass


def test_dequantize_in_chunks_gives_the_same_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """dequantize_into works CHUNK_BLOCKS blocks at a time (its temporaries stay small): chunks of 3 blocks
    give the values one chunk gives, bit for bit, over several rows and a partial last block."""
    x = torch.randn(3, 64 * 7 + 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for mode in fq.QUANTIZED:
        packed = torch.stack([fq.quantize(row, mode) for row in x])
        whole = torch.empty(x.numel(), dtype=torch.bfloat16)
        fq.dequantize_into(whole, packed, mode, x.shape[1])
        monkeypatch.setattr(fq, "CHUNK_BLOCKS", 3)
        chunked = torch.empty_like(whole)
        fq.dequantize_into(chunked, packed, mode, x.shape[1])
        monkeypatch.undo()
        assert torch.equal(whole, chunked), mode


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("numel", [64 * 7 + 5, 64 * 40, 64 * 2 + 60])
def test_dequantizing_rows_gathered_into_the_front_of_the_output_is_exact(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, numel: int
) -> None:
    """[Note: dequantizing in place]: the packed rows sit in the front of the output's own bytes (where
    a gather lands them) and dequantize, in chunks of 3 blocks, to the values a separate buffer gives."""
    monkeypatch.setattr(fq, "CHUNK_BLOCKS", 3)
    x = torch.randn(4, numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    for mode in fq.QUANTIZED:
        packed = torch.stack([fq.quantize(row, mode) for row in x])
        assert fq.fits_in_place(mode, numel, dtype), (mode, numel)
        apart = torch.empty(x.numel(), dtype=dtype)
        fq.dequantize_into(apart, packed, mode, numel)
        out = torch.full((x.numel(),), float("nan"), dtype=dtype)
        front = out.view(torch.uint8)[: packed.numel()].view(packed.shape)
        front.copy_(packed)
        fq.dequantize_into(out, front, mode, numel)
        assert torch.equal(out, apart), (mode, numel, dtype)
    assert not fq.fits_in_place("int8", 5, torch.bfloat16)  # 68 packed bytes against 10 of values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_hashing_a_piece_leaves_its_storage_resizable(dtype: torch.dtype) -> None:
    """piece_crc hashes a copy: .numpy() of the live storage makes it non-resizable for good, and a
    quantized base's shard is resized to 0 right after it was hashed (an fp32 base failed to wrap)."""
    from shardpar.runtime.frozen_exact import piece_crc

    t = (torch.randn(1000) * 100).to(dtype)
    expected = t[10:500].to(torch.float32 if dtype.is_floating_point else dtype).clone()
    assert piece_crc(t[10:500]) == zlib.crc32(expected.view(torch.uint8).numpy().tobytes())
    t.untyped_storage().resize_(0)  # raised "Trying to resize storage that is not resizable"
