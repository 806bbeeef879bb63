"""One step of adaptive SP groups for :class:`~flexorch.solver.step_planner.StepPlanner`: the MILP planner's plan
(:class:`~flexorch.solver.planner.Planner`), never worse than the BatchAda floor, with every static layout's
predicted time as a baseline (``solver.baselines.BaselineRun``: planned while the MILP solves run in the solver
process, and after the planner in the time kept for them). Under 'auto' recompute the planner has the first half of
the time and the packings for faster modes' bytes the rest (``solver.recompute``).

The answer is the planner's :class:`~flexorch.solver.planned_step.PlannedStep` with these added: the floor's plan
and status 'batchada' where the floor won, the baselines, and why the step runs a static layout where the planner
ran out of time (``fallback_reason`` 'timeout' and ``fallback_message``).
"""

from __future__ import annotations

import dataclasses
import time

from flexorch.solver.baselines import BaselineRun
from flexorch.solver.planned_step import PlannedStep
from flexorch.solver.planner import Planner
from flexorch.solver.recompute import choose_packing, other_packings, recompute_bound, uses_auto
from flexorch.solver.task_steps import MIN_PART_S

__all__ = ["plan_adaptive"]


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
) -> PlannedStep:
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
        plan, packings = choose_packing(plan, others, profile)
        predicted = packings.ran_ms
        bound = recompute_bound(plan, bound, profile)
    why = timeout_reason(sp, limit, skipped)
    return dataclasses.replace(
        sp,
        plan=plan,
        predicted_ms=predicted,
        bound_ms=bound,
        status=status,
        baselines_ms=baselines,
        fallback_reason="timeout" if why else None,
        fallback_message=why,
        solver_crashes=used["crashes"],
    )


def timeout_reason(sp: PlannedStep, limit: float, skipped: list[str]) -> str:
    """What a step that ran out of planning time should tell the user ('' when it did not)."""
    if not sp.out_of_time:
        return ""
    d = sp.details
    cut = f"; {d.get('solves_cut', 0)} MILP solve(s) cut at the deadline" if d.get("solves_cut") else ""
    more = f"; {len(skipped)} baseline layout(s) not planned" if skipped else ""
    return (
        f"the planner ran out of time (plan.time_limit_s={limit:g} s, used {sp.solve_s:.2f} s) before any MILP "
        f"candidate finished{cut}{more}: this step runs the best static layout found. Raise plan.time_limit_s, or "
        "give the planner more CPU (the machine is busy: other processes took the cores it needed)"
    )
