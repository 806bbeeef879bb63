"""Solving one candidate split's micro-batches by a deadline, on the solver process(es) the planner owns.

Each micro-batch's bisection MILP (``solver.milp``) is a job for the :class:`~flexorch.solver.solver_process.SolverPool`
(``isolate``: solver processes; else threads of this process). A native crash of the MILP library (SIGSEGV /
SIGABRT, coin-or/Cbc#693) costs that solve, not the plan: the micro-batch keeps its static start, the pool restarts and
the solve is retried while time is left; a solve still running at the deadline is killed the same way (a thread is
no longer waited for). Jobs carry the micro-batch's sequences with local indices (``_to_local`` / ``_to_global``).
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

from flexorch.solver.group_tables import GroupTables
from flexorch.solver.packing import Draft
from flexorch.solver.planner_config import PlannerConfig
from flexorch.solver.solver_process import SolverPool
from flexorch.solver.step_tables import StepTables

__all__ = ["MIN_SOLVE_S", "SplitSolver"]

MIN_SOLVE_S = 0.02
"""A MILP solve is not started with less time than this left: the static start is the answer then."""


class SplitSolver:
    """The planner's solver process(es) (``config.isolate``, ``config.workers``) and the solves of a split's
    micro-batches on them, each by a deadline."""

    def __init__(self, config: PlannerConfig):
        self.config = config
        self.pool = SolverPool(config.workers, config.isolate, config.solver)
        self.probes: list = []
        """Called as ``probe.at("solve", job)`` as each solve's job is made (``StepPlanner.add_probe``); a probe may
        add to ``job["before"]`` callables the solver process runs before the solve."""

    def close(self) -> None:
        self.pool.close()

    def solve(self, step: StepTables, split, lower_bounds, deadline, starts, run, wait_until=None, idle=None):
        """([(draft, method)] for each micro-batch of one split of ``step``'s batch, or None when one cannot be
        packed; True when every solve finished). A solve that is not back by `deadline`, or whose solver process
        died, leaves that micro-batch its static start (method 'timeout' / 'crash'); a crash restarts the solver
        process and the solve is retried while time is left. ``idle(until, stop)``: the caller's work while the
        solver process works, until ``until`` or until ``stop()`` says the solves are back (``isolate`` only)."""
        cfg = self.config
        wait_until = deadline if wait_until is None else max(deadline, wait_until)  # the solves aim at `deadline`
        kw = dict(
            max_buckets=cfg.max_buckets,
            tolerance=cfg.tolerance,
            max_bisection_steps=cfg.max_bisection_steps,
            ilp_time_limit_s=cfg.ilp_time_limit_s,
            solver=cfg.solver,
        )
        st = _SplitRun(split, lower_bounds, starts, step.groups, kw, deadline, wait_until, run)
        st.out = [None] * len(split)
        pending = []
        for i, (start, lower) in enumerate(zip(starts, lower_bounds, strict=True)):
            if cfg.stop_at_bound and start is not None and start.makespan() <= lower * (1 + cfg.tolerance):
                st.out[i] = (start, "bound")  # within the bisection's tolerance of its proven bound: nothing to solve
            else:
                pending.append(i)
        while pending:
            if deadline - time.monotonic() < MIN_SOLVE_S:
                st.give_up(pending)
                break
            if self.pool.isolate:  # all at once: the pool runs `workers` at a time
                futs = self._submit_all(st, pending, idle)
            else:
                futs = [(i, None) for i in pending]
            pending, unpackable = self._wait_round(st, futs)
            if unpackable:
                return None, st.complete
        if any(o is None for o in st.out):
            return None, st.complete
        return st.out, st.complete

    def _submit_all(self, st: _SplitRun, pending: list[int], idle) -> list:
        """[(micro-batch, future)] of the `pending` solves, all submitted to the solver process(es); then the
        caller's ``idle`` work while they run."""
        jobs = [self._job(st, i, math.inf) for i in pending]
        for pos, job in enumerate(jobs):  # when it starts: its part of the time left (those after it share)
            job["share_of"] = math.ceil((len(jobs) - pos) / self.config.workers)
        futs = [(i, self.pool.submit(job)) for i, job in zip(pending, jobs, strict=True)]
        if idle is not None:  # this process is free while the solver process works
            idle(st.wait_until, lambda fs=futs: all(f.done() for _, f in fs))
        return futs

    def _wait_round(self, st: _SplitRun, futs: list) -> tuple[list[int], bool]:
        """The solves of `futs` into ``st.out`` as they come back: (the micro-batches to solve again after a crash,
        True when one cannot be packed). A future of None is solved now, in this process, with its share of the time
        left."""
        for k, (i, fut) in enumerate(futs):
            if fut is None:  # in-process: one at a time, each with its share of the time now left
                left = st.deadline - time.monotonic()
                if left < MIN_SOLVE_S:
                    st.give_up([j for j, _ in futs[k:]])
                    break
                fut = self.pool.submit(self._job(st, i, left / (len(futs) - k)))
            try:
                got = fut.result(timeout=max(0.0, st.wait_until - time.monotonic()))
            except FutureTimeout:  # past its deadline: kill it (isolated) or stop waiting for it (a thread)
                self.pool.restart()
                rest = [j for j, f in futs[k:] if not _collect(f, j, st.split, st.out)] if self.pool.isolate else [i]
                st.give_up(rest)
                if self.pool.isolate:
                    break
                continue
            except BrokenProcessPool:  # the solver process died (a native crash): retry while time is left
                st.run["crashes"] += 1
                self.pool.restart()
                return [j for j, f in futs[k:] if not _collect(f, j, st.split, st.out)], False
            if got is None:
                return [], True
            st.out[i] = (_to_global(got[0], st.split[i]), got[1])
        return [], False

    def _job(self, st: _SplitRun, i: int, budget: float) -> dict:
        """The solve of micro-batch `i` as a job for the pool, its sequences with local indices."""
        items = list(st.split[i])
        start = st.starts[i]
        job = {
            "tables": st.tables.rows(items),
            "lower_bound_ms": st.lower_bounds[i],
            "start": None if start is None else _to_local(start, items),
            "kw": st.kw,
            "budget_s": budget,
            "deadline": st.deadline,
            "share_of": 1,
            "before": [],
        }
        for probe in self.probes:
            probe.at("solve", job)
        return job


@dataclass
class _SplitRun:
    """One split's solves: what each job needs, the answers so far and whether every solve finished."""

    split: list
    lower_bounds: list
    starts: list
    tables: GroupTables
    """The step's tables (``StepTables.groups``); a job carries its micro-batch's rows."""
    kw: dict
    """The MILP's arguments shared by every job (``solver.milp.solve_micro_batch``)."""
    deadline: float
    wait_until: float
    run: dict
    """The plan's counts: 'crashes', 'cut'."""
    out: list = field(default_factory=list)
    """[(draft, method)] or None, for each micro-batch."""
    complete: bool = True

    def give_up(self, idx) -> None:
        """Out of time: the micro-batches `idx` keep their static starts."""
        self.complete = False
        self.run["cut"] += len(idx)
        for i in idx:
            self.out[i] = None if self.starts[i] is None else (self.starts[i], "timeout")


def _collect(fut: Future | None, i: int, split, out) -> bool:
    """Put a solve that finished before its pool went down into `out`; False when it did not."""
    if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None or fut.result() is None:
        return False
    draft, method = fut.result()
    out[i] = (_to_global(draft, split[i]), method)
    return True


def _to_local(draft: Draft, items: list[int]) -> Draft:
    pos = {g: j for j, g in enumerate(items)}
    return Draft(
        list(draft.group_type), [[pos[i] for i in m] for m in draft.members], draft.loads.copy(), draft.tokens.copy()
    )


def _to_global(draft: Draft, items) -> Draft:
    items = list(items)
    return Draft(list(draft.group_type), [[items[j] for j in m] for m in draft.members], draft.loads, draft.tokens)
