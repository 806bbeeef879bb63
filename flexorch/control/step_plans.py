"""How the driver gets each step's plan: solved ahead while the previous step runs, taken when the step starts, and
the one lock the drain watch's thread goes through.

While a step runs, the driver asks the planner client for the next batch's plan (:meth:`StepPlans.ahead_of`), so the
solve overlaps the step; when the world is about to change size at a boundary, for the world it will have. When the
step starts it takes the plan (:meth:`StepPlans.plan`), solved by then or waited for. Each solve may take a share of
the last measured step (``[plan] budget``), and sees the world's nodes unless ``[plan] topology = "blind"``, and the
ranks' speeds (``control.speed_watch``) when ``[plan] speeds = "aware"`` and some worker runs off the others' pace.
A plan solved ahead is taken when it was solved for the same workers on the same nodes (the planner client keys its
solves by stream step, workers and topology) and no rank's speed has moved much since it was asked (``SPEED_MOVE``):
small moves are planned with from the next plan ahead, a step later, so steps do not wait for a solve at their start
(on 4 CPU workers, solving every changed plan again at the start cost most steps 0.4-1.0 s of waiting); a worker that
went slow or came back is planned for at once.

The drain watch (``control.drains``, its own thread) calls :meth:`StepPlans.without` when it sees a node draining
mid-step: the next batch's plan is then also solved for the world without that node's workers, so the step after
their leave finds it solved. Both paths read the last plan asked for ahead and call the planner client, from two
threads: :class:`StepPlans` holds a lock around that state and around the client calls they make. The wait in
:meth:`plan` does not take it, so a drain seen during a wait is not held up by it; the client guards its own table
of solves under way (``control.planner_client``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flexorch.config import TrainConfig
from flexorch.control.group import WorkerGroup
from flexorch.control.membership import world_topology
from flexorch.solver.step_planner import PlannedStep
from flexorch.solver.topology import Topology

if TYPE_CHECKING:
    from flexorch.control.speed_watch import SpeedWatch

__all__ = ["Ahead", "StepPlans"]

SPEED_MOVE = 0.25
"""A rank whose planning speed moved by this share since a plan was asked ahead has that plan solved again."""


@dataclass(frozen=True)
class Ahead:
    """The last plan asked for ahead: the stream step of its batch, the batch's lengths, the world's size, the
    seconds the solve may take and the planner's task arguments (``{"task_of": [...]}`` or {})."""

    step: int
    lengths: list[int]
    n: int
    budget_s: float
    task: dict
    topology: Topology | None = None
    """The topology it was asked with, the ranks' planning speeds then included."""


class StepPlans:
    """The plans of a run's steps on its ``workers``; ``corpus`` gives each batch's lengths and, in a run of
    ``[[tasks]]``, each document's task. Made as the world forms, when the drain watch starts; it plans once
    :meth:`use` gives it the run's config (as resolved) and planner client (nothing is planned ahead before, so a
    drain seen then needs nothing of it)."""

    def __init__(self, corpus, workers: WorkerGroup):
        self.corpus, self.workers = corpus, workers
        self.cfg: TrainConfig | None = None
        self.planner = None
        self.speeds: SpeedWatch | None = None  # each worker's speed (None: planned at one speed)
        self.last_step_ms: float | None = None  # the last trained step's measured time: the next plans' budget
        self._lock = threading.RLock()  # the run loop's thread and the drain watch's
        self._ahead: Ahead | None = None

    def use(self, cfg: TrainConfig, planner, speeds: SpeedWatch | None = None) -> None:
        """Plan for ``cfg`` (the run's config, as resolved) with ``planner`` (the run's planner client) and the
        workers' ``speeds`` (None: at one speed)."""
        with self._lock:
            self.cfg, self.planner, self.speeds = cfg, planner, speeds

    @property
    def ahead(self) -> Ahead | None:
        """The last plan asked for ahead (None before the first)."""
        with self._lock:
            return self._ahead

    def budget(self) -> float:
        """Seconds the next plan may take (``[plan] budget``): a share of the last measured step on GPU workers."""
        return self.cfg.plan.budget_for(self.last_step_ms, use_gpu=self.cfg.use_gpu)

    def task_of(self, batch) -> dict:
        """``{"task_of": [...]}`` (each document's task) for the planner in a run of ``[[tasks]]``; {} otherwise (a
        run of one task plans without it)."""
        if not self.cfg.tasks:
            return {}
        return {"task_of": [int(x) for x in self.corpus.task_of[list(batch.doc_ids)]]}

    def topology(self, n: int, without=()) -> Topology | None:
        """The nodes of a world of ``n`` workers: the members less ``without`` (``membership.world_topology``; None:
        one node, or ``[plan] topology = "blind"``), with the ranks' planning speeds in an SP run whose speeds are
        planned for (``SpeedWatch.planning_topology``: one node is then ``Topology.single(n)``)."""
        members = self.workers.worker_ids
        base = None
        if self.cfg.plan.topology != "blind":
            base = world_topology(members, self.workers.rank_nodes(), n, without)
        if self.speeds is None or self.cfg.pipelined or self.cfg.tasks:  # those plans are made at one speed
            return base
        gone = set(without)
        return self.speeds.planning_topology(base, n, [w for w in members if w not in gone])

    def plan(self, batch, lengths: list[int], n: int) -> PlannedStep:
        """The plan of ``batch`` (its documents' ``lengths``) on ``n`` workers: the one solved ahead, or solved now
        (the planner client falls back to a heuristic plan when the solve takes too long)."""
        topology = self.topology(n)
        with self._lock:
            ahead = self._ahead
        if ahead is not None and ahead.step == batch.step and ahead.n == n and _close(ahead.topology, topology):
            # solved ahead with the speeds known then, which differ little from the latest: taken as is rather than
            # solved again at the step's start (the step would wait for the solve)
            topology = ahead.topology
        return self.planner.plan(batch.step, lengths, n, self.budget(), topology=topology, **self.task_of(batch))

    def ahead_of(self, batch, n: int) -> None:
        """Start solving ``batch``'s plan for ``n`` workers (within the plan budget); :meth:`plan` takes it. From the
        run loop's thread."""
        lengths = [int(x) for x in self.corpus.lengths[list(batch.doc_ids)]]
        with self._lock:
            topology = self.topology(n)
            self._ahead = ahead = Ahead(batch.step, lengths, n, self.budget(), self.task_of(batch), topology)
            self.planner.plan_ahead(ahead.step, ahead.lengths, ahead.n, ahead.budget_s, topology=topology, **ahead.task)

    def without(self, workers: list[int]) -> None:
        """A drain was just seen on ``workers``' node: also solve the last batch asked for ahead for the world without
        them. From the drain watch's thread (mid-step) or the run loop's (at a boundary); best effort."""
        with self._lock:
            ahead = self._ahead
            if ahead is None:
                return
            m = ahead.n - len(set(workers) & set(self.workers.worker_ids))
            if not 1 <= m < ahead.n:
                return
            try:
                topology = self.topology(m, without=workers)
                self.planner.plan_ahead(
                    ahead.step, ahead.lengths, m, ahead.budget_s, also=True, topology=topology, **ahead.task
                )
            except Exception:  # noqa: BLE001 - best effort: the boundary solves it otherwise
                pass


def _close(a: Topology | None, b: Topology | None) -> bool:
    """Whether a plan solved for ``a`` stands for ``b``: the same nodes, and no rank's speed moved by
    ``SPEED_MOVE`` or more (a worker that went slow or came back is planned for at once; smaller moves wait for the
    next plan ahead)."""
    if (a is not None and a.num_nodes > 1) or (b is not None and b.num_nodes > 1):
        if a is None or b is None or a.without_speeds() != b.without_speeds():
            return False
    n = a.num_devices if a is not None else b.num_devices if b is not None else 0
    sa = a.rank_speeds() if a is not None else (1.0,) * n
    sb = b.rank_speeds() if b is not None else (1.0,) * n
    return len(sa) == len(sb) and all(abs(x - y) < SPEED_MOVE * max(x, y) for x, y in zip(sa, sb, strict=True))
