"""Faults a test injects into a worker: a probe that strikes at one point of one step.

A worker calls each of its probes at the points of a step (``flexorch.workers.step_context.PROBE_POINTS``: joining a
world, after a micro-batch's forward, before the gradient all-reduce, after it); a :class:`WorkerFault` added with
``Worker.add_probe`` counts its visits and strikes on the ``nth``. Production code never builds one: the elastic
tests and the recovery benchmark do, e.g. ``actor.add_probe.remote(WorkerFault("micro_batch", 2))``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from flexorch.workers.step_context import PROBE_POINTS

__all__ = ["ACTIONS", "WorkerFault"]

ACTIONS = ("exit", "hang", "raise", "oom")
"""``"exit"`` kills the worker's process at once (as a node loss would), ``"hang"`` blocks it forever, ``"raise"``
raises an error (a bug in the step: not a membership problem), ``"oom"`` raises the error a device out of memory
raises (``torch.OutOfMemoryError``)."""


@dataclass
class WorkerFault:
    """On the ``nth`` visit to ``point`` during ``step`` (for ``"join"``: the membership epoch), do ``action``."""

    point: str
    step: int
    nth: int = 1
    action: str = "exit"
    _visits: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.point not in PROBE_POINTS or self.action not in ACTIONS:
            raise ValueError(f"fault point must be one of {PROBE_POINTS} and action one of {ACTIONS}")

    def at(self, point: str, key: int) -> None:
        """Called by the worker at ``point`` of step (or epoch) ``key``."""
        if point != self.point or key != self.step:
            return
        self._visits += 1
        if self._visits != self.nth:
            return
        if self.action == "exit":
            os._exit(1)
        if self.action == "raise":
            raise RuntimeError(f"injected fault at {point} of step {key}")
        if self.action == "oom":
            raise torch.OutOfMemoryError(f"injected: CUDA out of memory at {point} of step {key}")
        time.sleep(10**6)
