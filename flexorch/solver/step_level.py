"""The level of a run's steps: how much slower or faster than the cost model prices them its steps run right now.

On CPU workers that share a machine's cores, the time of the same plan drifts within a run: the first steps warm up
the allocator and the caches, and every step shares the cores with the planner's solve of the next step and with
whatever else the machine runs, with the plans' shapes unchanged (docs/guide/planner.md has the demo's figures). A
refit (``solver.refit``) relevels the profile every few steps; between refits, the level is tracked here after every
step.

The level is one factor on a whole step's price, so no plan changes rank: the planner plans with the profile, and
the step's record prices its plan with the profile that planned it times the level the steps before it showed
(``records.writer.plan_fields``). It is an exponentially weighted mean of measured over predicted time of the most
recent steps (each priced by the same profile), the newest weighing ``LEVEL_ALPHA``.
"""

from __future__ import annotations

from collections.abc import Sequence

from flexorch.solver.profiles import Profile

__all__ = ["LEVEL_ALPHA", "LEVEL_BOUNDS", "LEVEL_STEPS", "step_level"]

LEVEL_ALPHA = 0.4
"""Weight of the newest step, chosen by replaying recorded runs of the demo and its Transformers twin (each step
leveled by the steps before it; the errors before and after are in docs/guide/planner.md)."""

LEVEL_STEPS = 8
"""The most recent steps the level is taken over (older ones weigh under 2 % at ``LEVEL_ALPHA``)."""

LEVEL_BOUNDS = (0.25, 4.0)
"""A step's measured/predicted ratio is clipped to this range: one step stalled by a hiccup of the machine (or a
step mispriced by a broken profile) moves the level by at most a bounded amount."""


def step_level(steps: Sequence, profile: Profile, alpha: float = LEVEL_ALPHA) -> float:
    """The level of ``steps`` (oldest first: ``solver.refit.StepSample``, measured ``ms`` and ``predict_ms``) priced
    by ``profile``: the exponentially weighted mean of measured / predicted over the last ``LEVEL_STEPS``; 1.0 when
    there are none."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    level = None
    lo, hi = LEVEL_BOUNDS
    for step in list(steps)[-LEVEL_STEPS:]:
        predicted = step.predict_ms(profile)
        if not predicted > 0:
            continue
        ratio = min(max(step.ms / predicted, lo), hi)
        level = ratio if level is None else (1.0 - alpha) * level + alpha * ratio
    return 1.0 if level is None else float(level)
