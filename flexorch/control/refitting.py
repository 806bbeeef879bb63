"""The run's cost model refitted beside its steps (``[plan] refit``): the driver hands each trained record here.

:class:`RunRefit` keeps the groups and the step of every record (``flexorch.solver.refit``: the first step on each
world is left out, it warms up process groups and the allocator, and so is a step that compiled, :func:`compiled`)
and every ``plan.refit_every`` steps refits the profile's time terms on them in a thread beside the next step, one
refit in flight at a time (its cost is in docs/guide/planner.md). The run's step level
(``solver.step_level``) is taken over the same steps.

A refit that predicts its window better is only *on trial*: the planner plans with it, and the next
``TRIAL_STEPS`` steps it planned are priced both by it (their own ``predicted_ms``) and by the profile before it.
It is kept for good when it predicts them at least as well, and rolled back otherwise. A window's steps cannot show
what a refit does to the plans it was not fitted on: the planner goes for whatever the new prices make cheapest, so a
refit that prices a group type it never saw too low is judged exactly on the steps that use that type (the demo's
case is in docs/guide/planner.md). No refit starts while one is on trial. The driver executes what this decides
(:class:`Verdict`) and decides nothing here.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import numpy as np

from flexorch.solver.profiles import Profile
from flexorch.solver.record_samples import StepSample, samples_of_record, step_of_record
from flexorch.solver.refit import GroupWindow, RefitReport, refit_times, with_time_terms
from flexorch.solver.step_level import step_level

__all__ = ["COMPILE_SHARE", "TRIAL_STEPS", "Change", "RunRefit", "Verdict", "compiled"]

COMPILE_SHARE = 0.02
"""A step on whose ranks ``torch.compile`` compiled for more than this share of its measured time is left out of the
window: its groups' times carry the compiles, not the plan (``[model] compile``: each new shape compiles the layers
again, so a run's first steps take longer than the same plans later; docs/guide/planner.md)."""

TRIAL_STEPS = 3
"""Steps planned with a refit before it is judged: the median of three steps' errors is not one step's noise."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A refit on trial judged on the steps planned with it: ``kept`` for good, or rolled back to ``before``."""

    refit_step: int
    """The step the refit followed."""
    step: int
    """The step whose record completed the trial."""
    kept: bool
    before: Profile
    """The profile in force before the refit (a roll-back restores its time terms)."""
    error: float
    """Median |relative error| of the trial steps as the refit predicted them."""
    error_before: float
    """The same steps priced by ``before``."""
    steps: int

    def message(self) -> str:
        what = "kept" if self.kept else "rolled back"
        return (
            f"step {self.step}: the cost model refit of step {self.refit_step} {what}: it predicted the {self.steps} "
            f"steps planned with it {100 * self.error:.1f} % off, the profile before it {100 * self.error_before:.1f} %"
            + ("" if self.kept else "; planning with the profile before it again")
        )


@dataclasses.dataclass
class _Trial:
    step: int
    revision: int
    before: Profile
    after: Profile
    errors: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # (after, before) per trial step


@dataclasses.dataclass(frozen=True)
class Change:
    """What the driver does after a step: plan with ``profile`` (None: keep the one in force) and say ``message``."""

    profile: Profile | None
    message: str


def compiled(record: dict) -> bool:
    """Some rank of this trained record compiled for more than :data:`COMPILE_SHARE` of the step (its ``compile_s``,
    ``flexorch.workers.compile.compile_seconds`` over the step)."""
    limit_s = COMPILE_SHARE * (record.get("measured_ms") or 0.0) / 1e3
    return any((rank.get("compile_s") or 0.0) > limit_s for rank in record.get("ranks") or () if rank)


class RunRefit:
    """The window of the run's recent groups and steps, the refit running on it (if any), and the refit on trial.

    :meth:`after_step` is the whole loop: the driver hands it each trained record and the profile that priced it,
    and applies the :class:`Change` s it returns. Each new profile is the next ``Profile.revision``."""

    def __init__(self, every: int, static: bool = False, trial_steps: int = TRIAL_STEPS) -> None:
        self.every = every
        self.static = static  # a static layout: the planner plans one group type (``refit_times``)
        self.trial_steps = trial_steps
        self.window = GroupWindow()
        self._warm = False  # a step has run on this world (its groups are not warm-up)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._inflight: tuple[int, concurrent.futures.Future] | None = None  # (step, refit)
        self._trial: _Trial | None = None

    def after_step(
        self, record: dict, step_no: int, current: Profile, priced_by: Profile | None = None, wait: bool = False
    ) -> list[Change]:
        """Take up a refit that has finished (``wait``: wait for the one in flight), then keep ``record`` (step
        ``step_no``, priced by ``priced_by``, default ``current``) and judge the refit on trial with it, and start
        the next refit when one is due. ``current``: the profile in force."""
        changes = self.settle(current, wait)
        if changes and changes[-1].profile is not None:
            current = changes[-1].profile
        verdict = self.observe(record, step_no, current, priced_by)
        if verdict is not None:
            # rolled back: its time terms out; the memory terms in force stay (an out-of-memory step may have lowered
            # them)
            back = None if verdict.kept else _next(with_time_terms(current, verdict.before), current)
            changes.append(Change(back, verdict.message()))
        return changes

    def settle(self, current: Profile, wait: bool = True) -> list[Change]:
        """A finished refit taken up: on trial when it predicts its window better (the planner plans with it), said
        in one line either way."""
        done = self.take(wait)
        if done is None:
            return []
        step, refit, report = done
        profile = None
        if report.accepted:
            profile = _next(with_time_terms(current, refit), current)  # memory terms are not refitted
            self._trial = _Trial(step, profile.revision, current, profile)
        if not report.refitted:  # nothing to fit on (an accepted refit always refitted something)
            return []
        return [Change(profile, f"step {step}: {report.message(profile or current)}")]

    def observe(self, record: dict, step_no: int, profile: Profile, priced_by: Profile | None = None) -> Verdict | None:
        """Keep a trained SP step's groups and step (not after a recovery: a new world warms up); judge the refit on
        trial with it when ``priced_by`` (the profile that planned and priced it) is that refit, returning the
        verdict once the trial is over; else after every ``every``-th step start a refit of ``profile`` (the one in
        force) on the window, unless one is in flight."""
        step = None
        if self._warm and not record["recoveries"] and not compiled(record):
            ratios = profile.mode_time_ratios()  # 'auto' recompute: each group counts at full recompute's time
            step = step_of_record(record, ratios)
            self.window.add([*samples_of_record(record, ratios), *([step] if step is not None else [])])
        self._warm = True
        if self._trial is not None:
            return self._judge(step, step_no, priced_by or profile)
        if (step_no + 1) % self.every or self._inflight is not None:
            return None
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flexorch-refit")
        self._inflight = (step_no, self._pool.submit(refit_times, profile, self.window.copy(), self.static))
        return None

    def _judge(self, step: StepSample | None, step_no: int, priced_by: Profile) -> Verdict | None:
        trial = self._trial
        if step is None or priced_by.revision != trial.revision:
            return None  # planned before the refit was taken up, or a warm-up step: says nothing about it
        after, before = (abs(step.predict_ms(p) - step.ms) / step.ms for p in (trial.after, trial.before))
        trial.errors.append((after, before))
        if len(trial.errors) < self.trial_steps:
            return None
        err_after, err_before = (float(np.median(col)) for col in zip(*trial.errors, strict=True))
        self._trial = None
        return Verdict(
            trial.step, step_no, err_after <= err_before, trial.before, err_after, err_before, self.trial_steps
        )

    def level(self, profile: Profile) -> float:
        """The level of the run's recent warm steps priced by ``profile`` (``solver.step_level``): what the next
        step's price by ``profile`` is multiplied by in its record; 1.0 before any warm step."""
        return step_level(self.window.steps(), profile)

    def take(self, wait: bool) -> tuple[int, Profile, RefitReport] | None:
        """A finished refit, once: (the step it followed, the refitted profile, its report); None when none has
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


def _next(profile: Profile, current: Profile) -> Profile:
    """``profile`` as the revision after ``current``'s (plans say which revision priced them)."""
    return dataclasses.replace(profile, revision=current.revision + 1)
