"""The run's cost model refitted beside its steps (``[plan] refit``): the driver hands each trained record here.

:class:`RunRefit` keeps the groups and the step of every record (``flexorch.solver.refit``: the first step on each
world is left out, it warms up process groups and the allocator) and every ``plan.refit_every`` steps refits the
profile's time terms on them in a thread beside the next step (0.04-0.7 s for 40-104 groups on these CPUs), one
refit in flight at a time. The driver takes a finished one up at its next step and decides nothing here: a kept
refit (:class:`~flexorch.solver.refit.RefitReport`) becomes its profile and the planner's.
"""

from __future__ import annotations

import concurrent.futures

from flexorch.solver.profiles import Profile
from flexorch.solver.recompute import time_ratios
from flexorch.solver.refit import GroupWindow, RefitReport, refit_times, samples_of_record, step_of_record

__all__ = ["RunRefit"]


class RunRefit:
    """The window of the run's recent groups and steps, and the refit running on it (if any)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.window = GroupWindow()
        self._warm = False  # a step has run on this world (its groups are not warm-up)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._inflight: tuple[int, concurrent.futures.Future] | None = None  # (step, refit)

    def observe(self, record: dict, step_no: int, profile: Profile) -> None:
        """Keep a trained SP step's groups and step (not after a recovery: a new world warms up); after every
        ``every``-th step start a refit of ``profile`` on the window, unless one is in flight."""
        if self._warm and not record["recoveries"]:
            ratios = time_ratios(profile)  # 'auto' recompute: each group counts at full recompute's time
            step = step_of_record(record, ratios)
            self.window.add([*samples_of_record(record, ratios), *([step] if step is not None else [])])
        self._warm = True
        if (step_no + 1) % self.every or self._inflight is not None:
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flexorch-refit")
        self._inflight = (step_no, self._pool.submit(refit_times, profile, self.window.copy()))

    def take(self, wait: bool) -> tuple[int, Profile, RefitReport] | None:
        """A finished refit, once: (the step it followed, the profile to plan with, its report); None when none has
        finished (``wait``: wait for the one in flight)."""
        if self._inflight is None or not (wait or self._inflight[1].done()):
            return None
        step, future = self._inflight
        self._inflight = None
        profile, report = future.result()
        return step, profile, report

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool, self._inflight = None, None
