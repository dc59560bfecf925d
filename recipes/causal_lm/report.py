"""What rank 0 shows and records: a progress line, metrics.jsonl, per-rank memory.

On a terminal the progress line rewrites itself (`\\r`); when stdout is a file or a pipe it prints one
line every `log_every` steps instead, so logs stay readable.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch


def peak_rss_mib() -> float:
    """This process's peak resident memory (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def device_peak_mib(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return None


@dataclass
class StepRecord:
    step: int
    loss: float
    lr: float
    grad_norm: float | None
    step_time_s: float
    tokens_per_s: float
    tokens: int
    rss_mib: list[float]
    device_mib: list[float] | None = None
    loss_scale: float | None = None

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if v is not None}
        out["time"] = round(time.time(), 3)
        return out


@dataclass
class Progress:
    total_steps: int
    mode: str = "auto"  # auto | bar | lines | none
    log_every: int = 0
    stream: TextIO = field(default_factory=lambda: sys.stdout)
    _start: float = field(default_factory=time.perf_counter)
    _first_step: int | None = None
    _open_line: bool = False

    def __post_init__(self) -> None:
        if self.mode == "auto":
            self.mode = "bar" if self.stream.isatty() else "lines"
        if self.log_every <= 0:
            self.log_every = max(1, self.total_steps // 20)

    def update(self, rec: StepRecord) -> None:
        if self.mode == "none":
            return
        if self._first_step is None:
            self._first_step, self._start = rec.step, time.perf_counter()
        line = self._line(rec)
        if self.mode == "bar":
            self.stream.write("\r" + line.ljust(118)[:118])
            self._open_line = True
            if rec.step == self.total_steps:
                self.close()
        elif rec.step % self.log_every == 0 or rec.step == self.total_steps or rec.step == self._first_step:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line of its own, never glued to an open progress bar."""
        if self.mode == "none":
            return
        self.close()
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False

    def _line(self, rec: StepRecord) -> str:
        width = 20
        done = int(width * rec.step / self.total_steps)
        bar = "#" * done + "." * (width - done)
        mem = rec.device_mib if rec.device_mib is not None else rec.rss_mib
        kind = "gpu" if rec.device_mib is not None else "rss"
        return (
            f"step {rec.step:>{len(str(self.total_steps))}}/{self.total_steps} [{bar}] loss {rec.loss:.4f}"
            f" | {rec.tokens_per_s:,.0f} tok/s | {rec.step_time_s * 1e3:.0f} ms/step"
            f" | {kind}/rank {min(mem):.0f}-{max(mem):.0f} MiB | eta {self._eta(rec.step)}"
        )

    def _eta(self, step: int) -> str:
        if self._first_step is None or step <= self._first_step:
            return "--:--"
        per = (time.perf_counter() - self._start) / (step - self._first_step)
        left = int(per * (self.total_steps - step))
        return f"{left // 60}:{left % 60:02d}"


class MetricsLog:
    """metrics.jsonl, one record per optimizer step; a resumed run drops records past its start."""

    def __init__(self, path: Path, *, resume_step: int | None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        if resume_step is not None and path.exists():
            kept = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= resume_step]
        path.write_text("".join(ln + "\n" for ln in kept))
        self._file = path.open("a")

    def write(self, rec: StepRecord) -> None:
        self._file.write(json.dumps(rec.to_json()) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln]


def smooth(values: list[float], window: int) -> list[float]:
    """Centred moving mean over up to `window` values (the loss curve's darker line; no lag)."""
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    n, out = len(values), []
    for i in range(n):
        half = min(window // 2, i, n - 1 - i)  # symmetric near the ends too: no bias at a steep start
        lo, hi = i - half, i + half + 1
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out


def fmt_bytes(n: float) -> str:
    if n <= 0 or math.isnan(n):
        return "0 B"
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = min(int(math.log(n, 1024)), len(units) - 1)
    return f"{n / 1024**i:.2f} {units[i]}" if i else f"{n:.0f} B"
