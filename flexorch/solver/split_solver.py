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

from flexorch.solver.packing import Draft
from flexorch.solver.planner_config import PlannerConfig
from flexorch.solver.solver_process import SolverPool

__all__ = ["MIN_SOLVE_S", "SplitSolver"]

MIN_SOLVE_S = 0.02
"""A MILP solve is not started with less time than this left: the static start is the answer then."""


class SplitSolver:
    """The planner's solver process(es) (``config.isolate``, ``config.workers``) and the solves of a split's
    micro-batches on them, each by a deadline."""

    def __init__(self, config: PlannerConfig):
        self.config = config
        self.pool = SolverPool(config.workers, config.isolate, config.solver)
        self.crashes_to_inject = 0
        """Test seam (``Planner.inject_crashes``): this many next solves' solver processes kill themselves."""

    def close(self) -> None:
        self.pool.close()

    def solve(
        self,
        split,
        lower_bounds,
        types,
        caps_t,
        overheads,
        table,
        lengths,
        n,
        deadline,
        starts,
        run,
        wait_until=None,
        idle=None,
    ):
        """([(draft, method)] for each micro-batch of one split, or None when one cannot be packed; True when every
        solve finished). A solve that is not back by `deadline`, or whose solver process died, leaves that
        micro-batch its static start (method 'timeout' / 'crash'); a crash restarts the solver process and the
        solve is retried while time is left. ``idle(until, stop)``: the caller's work while the solver process works,
        until ``until`` or until ``stop()`` says the solves are back (``isolate`` only)."""
        cfg = self.config
        wait_until = deadline if wait_until is None else max(deadline, wait_until)  # the solves aim at `deadline`
        kw = dict(
            num_devices=n,
            caps_by_type=caps_t,
            overheads=overheads,
            max_buckets=cfg.max_buckets,
            tolerance=cfg.tolerance,
            max_bisection_steps=cfg.max_bisection_steps,
            ilp_time_limit_s=cfg.ilp_time_limit_s,
            solver=cfg.solver,
        )
        out: list = [None] * len(split)
        pending = list(range(len(split)))
        complete = True

        def give_up(idx) -> None:  # out of time: the static starts
            nonlocal complete
            complete = False
            run["cut"] += len(idx)
            for i in idx:
                out[i] = None if starts[i] is None else (starts[i], "timeout")

        while pending:
            lost: list[int] = []
            if deadline - time.monotonic() < MIN_SOLVE_S:
                give_up(pending)
                break
            if self.pool.isolate:  # all at once: the pool runs `workers` at a time
                jobs = [
                    self._job(split[i], lower_bounds[i], starts[i], types, table, lengths, kw, math.inf, deadline)
                    for i in pending
                ]
                for pos, job in enumerate(jobs):  # when it starts: its part of the time left (those after it share)
                    job["share_of"] = math.ceil((len(jobs) - pos) / cfg.workers)
                futs = [(i, self.pool.submit(job)) for i, job in zip(pending, jobs, strict=True)]
                if idle is not None:  # this process is free while the solver process works
                    idle(wait_until, lambda fs=futs: all(f.done() for _, f in fs))
            else:
                futs = [(i, None) for i in pending]
            for k, (i, fut) in enumerate(futs):
                if fut is None:  # in-process: one at a time, each with its share of the time now left
                    left = deadline - time.monotonic()
                    if left < MIN_SOLVE_S:
                        give_up([j for j, _ in futs[k:]])
                        break
                    job = self._job(
                        split[i],
                        lower_bounds[i],
                        starts[i],
                        types,
                        table,
                        lengths,
                        kw,
                        left / (len(futs) - k),
                        deadline,
                    )
                    fut = self.pool.submit(job)
                try:
                    got = fut.result(timeout=max(0.0, wait_until - time.monotonic()))
                except FutureTimeout:  # past its deadline: kill it (isolated) or stop waiting for it (a thread)
                    self.pool.restart()
                    rest = [j for j, f in futs[k:] if not _collect(f, j, split, out)] if self.pool.isolate else [i]
                    give_up(rest)
                    if self.pool.isolate:
                        break
                    continue
                except BrokenProcessPool:  # the solver process died (a native crash): retry while time is left
                    run["crashes"] += 1
                    self.pool.restart()
                    lost = [j for j, f in futs[k:] if not _collect(f, j, split, out)]
                    break
                if got is None:
                    return None, complete
                out[i] = (_to_global(got[0], split[i]), got[1])
            pending = lost
        if any(o is None for o in out):
            return None, complete
        return out, complete

    def _job(self, items, lower_bound, start, types, table, lengths, kw, budget, deadline) -> dict:
        crash = self.crashes_to_inject > 0
        if crash:
            self.crashes_to_inject -= 1
        items = list(items)
        return {
            "table": table[items],
            "lengths": lengths[items],
            "types": types,
            "lower_bound_ms": lower_bound,
            "start": None if start is None else _to_local(start, items),
            "kw": kw,
            "budget_s": budget,
            "deadline": deadline,
            "crash": crash,
            "share_of": 1,
        }


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
