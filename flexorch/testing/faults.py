"""Faults a test injects: probes that strike a worker at one point of one step, or the planner.

A worker calls each of its probes at the points of a step (``flexorch.workers.step_context.PROBE_POINTS``: joining a
world, after a micro-batch's forward, before the gradient all-reduce, after it); a :class:`WorkerFault` added with
``Worker.add_probe`` counts its visits and strikes on the ``nth``. Production code never builds one: the elastic
tests and the recovery benchmark do, e.g. ``actor.add_probe.remote(WorkerFault("micro_batch", 2))``.

The planner calls its probes as each plan starts and as each MILP solve's job is made
(``flexorch.solver.step_planner.StepPlanner.add_probe``): :class:`PlannerHang` makes plan calls never return (a stuck
CBC solve), :class:`SolverCrash` makes solver processes die as a native crash of the MILP library does. The module
imports neither torch nor Ray (a solver process unpickles its crash without them).
"""

from __future__ import annotations

import functools
import os
import signal
import time
from dataclasses import dataclass, field

__all__ = ["ACTIONS", "PlannerHang", "SolverCrash", "WorkerFault"]

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
        from flexorch.workers.step_context import PROBE_POINTS  # torch: imported where a worker fault is made

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
            import torch

            raise torch.OutOfMemoryError(f"injected: CUDA out of memory at {point} of step {key}")
        time.sleep(10**6)


@dataclass
class PlannerHang:
    """The next ``calls`` plan calls block forever, as a stuck CBC solve does."""

    calls: int = 1

    def at(self, point: str, key) -> None:
        if point == "plan" and self.calls > 0:
            self.calls -= 1
            time.sleep(10**6)


@dataclass
class SolverCrash:
    """The solver process of each of the next ``solves`` MILP solves kills itself with SIGSEGV, as a native crash of
    the MILP library does (``PlannerConfig(isolate=True)``: in a thread it would take the planner down, so there it
    raises instead)."""

    solves: int = 1

    def at(self, point: str, job) -> None:
        if point == "solve" and self.solves > 0:
            self.solves -= 1
            job["before"].append(functools.partial(_segfault, os.getpid()))


def _segfault(planner_pid: int) -> None:
    if os.getpid() == planner_pid:
        raise RuntimeError("SolverCrash needs PlannerConfig(isolate=True): in-process it would kill the planner")
    os.kill(os.getpid(), signal.SIGSEGV)
