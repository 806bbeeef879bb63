"""Rows: status, reason, timing; a failing row is recorded and the next one runs. ``Ctx`` is what every row reads."""

from __future__ import annotations

import contextlib
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .sizes import Sizes

__all__ = ["Check", "Ctx", "FailRow", "Row", "SkipRow", "last_line"]


class SkipRow(Exception):
    """Raised inside a row: the row is skipped with this reason."""


class FailRow(Exception):
    """Raised inside a row: the row failed with this reason (no traceback needed)."""


@dataclass
class Row:
    """One line of the table."""

    key: str
    """Stable id, the same in both modes: 'a.pytest', 'a.test:<test id>', 'b.attn.<backend>', 'c.ring.d4', ..."""
    name: str
    status: str = "passed"
    """'passed', 'failed' or 'skipped'."""
    reason: str = ""
    """Why it failed or was skipped (a failure's last traceback line)."""
    detail: str = ""
    """What was measured, in words."""
    time_s: float = 0.0
    metrics: dict = field(default_factory=dict)
    """The numbers behind ``detail`` (table.json)."""


def last_line(exc: BaseException | None = None) -> str:
    """The last line of the current traceback (the exception and its message)."""
    lines = traceback.format_exc().strip().splitlines()
    return lines[-1] if lines else repr(exc)


class Check:
    """Collects rows and prints a progress line as each starts and ends."""

    def __init__(self) -> None:
        self.rows: list[Row] = []

    @contextlib.contextmanager
    def row(self, key: str, name: str):
        r = Row(key, name)
        print(f"[{key}] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            yield r
        except SkipRow as e:
            r.status, r.reason = "skipped", str(e)
        except FailRow as e:
            r.status, r.reason = "failed", str(e)
        except Exception as e:  # noqa: BLE001 - one row's failure must not stop the others
            r.status, r.reason = "failed", last_line(e)
        r.time_s += time.perf_counter() - t0  # plus any share of a job run before the row
        self.add(r)

    def add(self, r: Row, *, started: bool = True) -> None:
        """Record ``r``; ``started`` False: a row with no start line of its own (named in its line)."""
        self.rows.append(r)
        said = r.reason or r.detail
        head = "    " if started else f"[{r.key}] "
        print(f"{head}{r.status} ({r.time_s:.1f} s){': ' + said if said else ''}", flush=True)


@dataclass
class Ctx:
    """What every row reads: the mode's sizes, the device, the output directory, the measured peak."""

    sizes: Sizes
    device: torch.device
    out: Path
    dry: bool
    peak_tflops: float | None = None
    step: dict | None = None
    """d.step's measurements (its batch and median step time), for e.predict."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        """Attention rows: bf16 on CUDA (the fused kernels' dtype), fp32 on CPU."""
        return torch.bfloat16 if self.cuda else torch.float32

    def no_cuda(self, what: str = "") -> str:
        why = "no CUDA" if not torch.cuda.is_available() else "no CUDA (--dry runs on the CPU)"
        return f"{why}{': ' + what if what else ''}"
