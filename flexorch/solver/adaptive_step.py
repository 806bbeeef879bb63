"""One step of adaptive SP groups for :class:`~flexorch.solver.step_planner.StepPlanner`: the MILP planner's plan
(:class:`~flexorch.solver.planner.Planner`), never worse than the BatchAda floor, with every static layout's
predicted time as a baseline (``solver.baselines.BaselineRun``: planned while the MILP solves run in the solver
process, and after the planner in the time kept for them). Under 'auto' recompute the planner has the first half of
the time and the packings for faster modes' bytes the rest (``solver.recompute``).

The answer is an :class:`AdaptiveStep`; the step planner reports it as its ``PlannedStep``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from flexorch.solver.baselines import BaselineRun
from flexorch.solver.plan import Plan
from flexorch.solver.planner import Planner
from flexorch.solver.recompute import choose_packing, other_packings, recompute_bound, uses_auto
from flexorch.solver.task_steps import MIN_PART_S

__all__ = ["AdaptiveStep", "plan_adaptive"]


@dataclass(frozen=True)
class AdaptiveStep:
    """A step of adaptive SP groups as :func:`plan_adaptive` planned it."""

    plan: Plan
    predicted_ms: float
    bound_ms: float
    status: str
    """The planner's status, or 'batchada' where the floor won."""
    baselines_ms: dict
    fallback: str
    """Why the step runs a static layout after the planner ran out of time ('' when it did not)."""


def plan_adaptive(
    planner: Planner,
    lengths,
    num_devices: int,
    limit: float,
    start: float,
    deadline: float,
    baselines_s,
    used: dict,
    topology=None,
) -> AdaptiveStep:
    """The step of ``lengths`` on ``num_devices`` by ``deadline`` (``limit`` seconds after ``start``). The baselines
    keep what they took last step (``baselines_s``, None at first) x1.5, 10-40 % of the budget (40 % at first).
    ``used['crashes']``: the solver crashes so far, ``used['baselines_s']``: what the baselines took after the
    planner (the time to keep for them next step), both set also when this raises later. ``topology``: the plan and
    the baselines placed on its nodes and priced where their groups lie (``solver.topology``)."""
    profile = planner.profile
    keep = 0.4 * limit if baselines_s is None else min(0.4 * limit, max(0.1 * limit, 1.5 * baselines_s))
    run = BaselineRun(lengths, num_devices, profile, topology=topology)
    auto = uses_auto(profile)  # [sharding] activation_checkpointing = "auto": several packings
    due = deadline - keep
    first = start + 0.5 * (due - start) if auto else due
    sp = planner.plan(lengths, num_devices, deadline=first, idle=run.advance, topology=topology)
    used["crashes"] = sp.solver_crashes
    plan, predicted, bound, status = sp.plan, sp.predicted_ms, sp.bound_ms, sp.status
    others = {}
    if auto:  # packed for the bytes of a mode some group of full's packing could not run in
        others, more = other_packings(planner, plan, lengths, num_devices, due, run.advance, min_s=MIN_PART_S)
        used["crashes"] += more
    b0 = time.monotonic()
    run.advance(deadline - 0.02 * limit)  # 2 % of the budget for the answer itself
    statics, baselines, skipped = run.result()
    used["baselines_s"] = time.monotonic() - b0
    floor, floor_ms = statics["batchada"], baselines["batchada"]
    if floor_ms < predicted:  # out of time before beating the best static layout: never plan worse
        plan, predicted, status = floor, floor_ms, "batchada"
    if auto:  # each group in its mode; the fastest packing in that time model
        plan, packing = choose_packing(plan, others, profile)
        predicted = packing[f"{packing['packing']}_ms"]
        bound = recompute_bound(plan, bound, profile)
    return AdaptiveStep(plan, predicted, bound, status, baselines, timeout_reason(sp, limit, skipped))


def timeout_reason(sp, limit: float, skipped: list[str]) -> str:
    """What a step that ran out of planning time should tell the user ('' when it did not)."""
    if sp.status != "fallback":
        return ""
    d = sp.details
    cut = f"; {d.get('solves_cut', 0)} MILP solve(s) cut at the deadline" if d.get("solves_cut") else ""
    more = f"; {len(skipped)} baseline layout(s) not planned" if skipped else ""
    return (
        f"the planner ran out of time (plan.time_limit_s={limit:g} s, used {sp.solve_s:.2f} s) before any MILP "
        f"candidate finished{cut}{more}: this step runs the best static layout found. Raise plan.time_limit_s, or "
        "give the planner more CPU (the machine is busy: other processes took the cores it needed)"
    )
