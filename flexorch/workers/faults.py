"""Fault injection into a worker, the seam the elastic tests and the recovery benchmark strike through.

A test names a point of a step (:data:`FAULT_POINTS`), the step, which visit, and what happens there
(:meth:`FaultSeam.inject_fault`); the worker calls :meth:`FaultSeam._strike` at each point, which does nothing
unless a fault was injected.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import torch

__all__ = ["FAULT_POINTS", "FaultSeam"]

FAULT_POINTS = ("join", "micro_batch", "before_sync", "after_sync")
"""Where :meth:`Worker.inject_fault` can strike: joining a world, after a micro-batch's forward, before the
gradient all-reduce, after it (before the optimizer step)."""


class FaultSeam:
    """Mixed into :class:`~flexorch.workers.actor.Worker`: the injected faults and the visits counted."""

    _faults: list[tuple[str, int, int, str]]
    _calls: Counter

    def inject_fault(self, point: str, step: int, nth: int = 1, action: str = "exit") -> None:
        """Test seam: on the ``nth`` visit to ``point`` during ``step`` (for ``"join"``: membership epoch),
        ``"exit"`` kills this process at once (as a node loss would), ``"hang"`` blocks it forever, ``"raise"``
        raises an error (a bug in the step: not a membership problem), ``"oom"`` raises the error a device out of
        memory raises (``torch.OutOfMemoryError``)."""
        if point not in FAULT_POINTS or action not in ("exit", "hang", "raise", "oom"):
            raise ValueError(f"fault point must be one of {FAULT_POINTS} and action 'exit', 'hang', 'raise' or 'oom'")
        self._faults.append((point, step, nth, action))

    def _strike(self, point: str, step: int) -> None:
        if not self._faults:
            return
        self._calls[(point, step)] += 1
        for p, s, nth, action in self._faults:
            if p == point and s == step and nth == self._calls[(point, step)]:
                if action == "exit":
                    os._exit(1)
                if action == "raise":
                    raise RuntimeError(f"injected fault at {point} of step {step}")
                if action == "oom":
                    raise torch.OutOfMemoryError(f"injected: CUDA out of memory at {point} of step {step}")
                time.sleep(10**6)
