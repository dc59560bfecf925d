"""Block-quantized int8 for the cross-node hop only (issue 28, ZeRO++'s qwZ and qgZ).

[Note: cross-node quantization]
Across nodes bandwidth is scarce and inside a node it is not, so only the cross-node hop of a
spanning group's collectives is quantized; the node hop, the fp32 main values, the optimizer and the
main grads stay exact.

    weights   (sdp_quantize_cross_node_weights): the hierarchical AllGather's cross step sends each
              shard as int8 plus one fp32 scale per block of QBLOCK elements (absmax / 127), and every
              rank -- the shard's owner too -- computes with the dequantized values, so all ranks of the
              group hold the same weights (the owner using its exact shard would make them differ by
              node). 1 + 4/QBLOCK bytes per element instead of 2 (bf16) or 4 (fp32).
    gradients (sdp_quantize_cross_node_gradients): the two-hop ReduceScatter's cross hop sends each
              node block of the node sums as int8 + scales by AllToAll; the receiver dequantizes and
              sums in fp32, in rank order. Error feedback (1-bit Adam, LoCo): what quantization
              dropped from a rank's node sums is kept (fp32, N x the shard per rank) and added to the
              next step's before they are quantized, so the error does not accumulate over steps.

Absmax scaling bounds each element's error by half a quantization step, absmax / 254 of its block.
Off, neither path runs: results are bit-identical to the unquantized code.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from shardpar.collectives.base import Work

QBLOCK = 256


def padded(numel: int) -> int:
    return -(-numel // QBLOCK) * QBLOCK


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, n] floats -> (int8 [rows, padded(n)], fp32 scales [rows, padded(n) / QBLOCK]); each row
    quantized on its own (a row is what one peer receives)."""
    rows, n = x.shape
    full = torch.zeros(rows, padded(n), dtype=torch.float32, device=x.device)
    full[:, :n] = x
    blocks = full.view(rows, -1, QBLOCK)
    scales = blocks.abs().amax(dim=2) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe.unsqueeze(2)).clamp_(-127, 127).to(torch.int8)
    return q.view(rows, -1), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize`: [rows, n] in `dtype`."""
    rows = q.shape[0]
    values = q.view(rows, -1, QBLOCK).to(torch.float32) * scales.unsqueeze(2)
    return values.view(rows, -1)[:, :n].to(dtype)


def wire_bytes_per_element() -> float:
    """Bytes one quantized element costs on the wire, its share of the block's scale included."""
    return 1 + 4 / QBLOCK


class FinishingWork:
    """Collectives, then a local step (dequantizing what they brought), run once by the first `wait` --
    on whichever thread waits: the node step's, or the reducer's drain."""

    def __init__(self, works: list[Work], finish: Callable[[], None]) -> None:
        self._works, self._finish = works, finish
        self._lock = threading.Lock()
        self._done = False

    def wait(self, timeout: float | None = None) -> None:
        with self._lock:
            if self._done:
                return
            for work in self._works:
                work.wait(timeout)
            self._finish()
            self._done = True

    def is_completed(self) -> bool:
        return self._done
