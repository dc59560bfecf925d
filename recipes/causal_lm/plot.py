"""A loss-curve PNG with no plotting dependency: an RGB canvas, lines, a 3x5 pixel font and a
zlib-compressed PNG (IHDR, IDAT, IEND) written by hand.

    +---------------------------------------------+
    | LOSS                                        |
    | 4.2 +-----------------------------------+   |
    |     |\\  raw (light)                    |   |
    | 2.1 |  ``--..__  smoothed (dark)        |   |
    |     +-----------------------------------+   |
    |     0                STEP             60  |
    +---------------------------------------------+
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from pathlib import Path

Color = tuple[int, int, int]
WHITE: Color = (255, 255, 255)
GRID: Color = (225, 225, 225)
AXIS: Color = (90, 90, 90)
RAW: Color = (160, 190, 235)
SMOOTH: Color = (20, 70, 170)

_FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    "E": "111100111100111", "L": "100100100100111", "O": "111101101101111", "P": "111101111100100",
    "S": "111100111001111", "T": "111010010010010", "K": "101110100110101", " ": "000000000000000",
}  # fmt: skip


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(WHITE * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, *, thick: int = 1) -> None:
        """Bresenham, `thick` pixels wide (square pen)."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for ox in range(thick):
                for oy in range(thick):
                    self.set(x0 + ox, y0 + oy, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x: int, y: int, s: str, color: Color, *, scale: int = 2) -> None:
        for ch in s.upper():
            glyph = _FONT.get(ch, _FONT[" "])
            for i, bit in enumerate(glyph):
                if bit == "1":
                    for ox in range(scale):
                        for oy in range(scale):
                            self.set(x + (i % 3) * scale + ox, y + (i // 3) * scale + oy, color)
            x += 4 * scale

    def png(self) -> bytes:
        rows = b"".join(
            b"\x00" + bytes(self.pixels[3 * y * self.width : 3 * (y + 1) * self.width]) for y in range(self.height)
        )

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (
            b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 6)) + chunk(b"IEND", b"")
        )


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (1, 2, 5 x 10^k spacing)."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _label(v: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"{v:.{decimals}f}"


def loss_curve(
    path: Path, steps: list[int], raw: list[float], smoothed: list[float], *, size: tuple[int, int] = (720, 420)
) -> None:
    """Write the loss curve (light: per step, dark: smoothed) to `path` as PNG."""
    if not steps:
        raise ValueError("loss_curve needs at least one step")
    c = Canvas(*size)
    left, right, top, bottom = 70, size[0] - 25, 40, size[1] - 45
    x_lo, x_hi = min(steps), max(max(steps), min(steps) + 1)
    finite = [v for v in raw + smoothed if math.isfinite(v)] or [0.0]
    y_lo, y_hi = min(finite), max(finite)
    pad = (y_hi - y_lo) * 0.05 or 0.5
    y_lo, y_hi = y_lo - pad, y_hi + pad

    def px(step: float, value: float) -> tuple[int, int]:
        x = left + (step - x_lo) / (x_hi - x_lo) * (right - left)
        y = bottom - (value - y_lo) / (y_hi - y_lo) * (bottom - top)
        return round(x), round(y)

    yt = nice_ticks(y_lo, y_hi)
    for v in yt:
        _, y = px(x_lo, v)
        c.line(left, y, right, y, GRID)
        c.text(8, y - 5, _label(v, yt[1] - yt[0] if len(yt) > 1 else 1.0), AXIS)
    for v in nice_ticks(x_lo, x_hi, 6):
        x, _ = px(v, y_lo)
        c.line(x, top, x, bottom, GRID)
        c.text(x - 8, bottom + 8, f"{v:.0f}", AXIS)
    c.line(left, bottom, right, bottom, AXIS)
    c.line(left, top, left, bottom, AXIS)
    c.text(left, 12, "LOSS", AXIS, scale=3)
    c.text((left + right) // 2 - 20, size[1] - 18, "STEP", AXIS)
    for values, color, thick in ((raw, RAW, 1), (smoothed, SMOOTH, 2)):
        pts = [px(s, v) for s, v in zip(steps, values, strict=True) if math.isfinite(v)]
        for (xa, ya), (xb, yb) in itertools.pairwise(pts):
            c.line(xa, ya, xb, yb, color, thick=thick)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(c.png())
