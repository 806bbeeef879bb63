"""CPU hogs for benchmarks: ``with cpu_hogs(n): ...`` runs the block beside ``n`` busy-looping processes.

A busy shared head node starves the planner of CPU (issue 21: CBC crashed when its time limit fell inside its
preprocessing on a starved CPU); this reproduces that on purpose, for as short a time as the block takes. The hogs
are plain subprocesses of this interpreter, each killed by its own pid when the block exits, however it exits.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["cpu_hogs"]

_BUSY_LOOP = "while True: pass"


@contextmanager
def cpu_hogs(n: int) -> Iterator[list[int]]:
    """Run the block beside ``n`` processes that each spin one core flat out; yields their pids. ``n = 0`` runs the
    block quiet. The hogs are killed (SIGKILL, then reaped) when the block ends, also on an exception or Ctrl-C."""
    if n < 0:
        raise ValueError(f"cpu_hogs needs n >= 0, got {n}")
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _BUSY_LOOP],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
