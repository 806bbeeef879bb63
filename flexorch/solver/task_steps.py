"""A step of several tasks for :class:`~flexorch.solver.step_planner.StepPlanner`: Spindle's schedule
(:func:`flexorch.solver.multitask.execute.plan_task_step`) with the MILP planner's SP plan for every part, and the
tasks in turn as the baseline it must beat in the time model the workers run.

The answer is a :class:`~flexorch.solver.planned_step.PlannedStep` (``bound_ms`` 0) that the step planner completes.
"""

from __future__ import annotations

import time

from flexorch.solver.baselines import BaselineRun, baseline_plans
from flexorch.solver.errors import PlanningError
from flexorch.solver.multitask.execute import plan_task_step
from flexorch.solver.plan import Plan
from flexorch.solver.planned_step import PlannedStep
from flexorch.solver.planner import Planner
from flexorch.solver.profiles import Profile
from flexorch.solver.recompute import choose_packing, other_packings, uses_auto, with_chosen_modes
from flexorch.solver.simulator import step_time_ms

__all__ = ["MIN_PART_S", "check_task_mode", "plan_tasks"]

MIN_PART_S = 0.02
"""A task part's MILP planner (or a packing for a faster recompute mode) is not started with less time than this
left: its BatchAda plan (no packing) is the answer."""


def check_task_mode(static, pipeline_stages) -> None:
    """Several tasks are planned with adaptive SP groups only."""
    if pipeline_stages != 1:
        raise PlanningError("pipeline stages with several tasks are not supported yet")
    if static is not None:
        raise PlanningError(f"a static layout ({static[0]} x{static[1]}) with several tasks is not supported yet")


def plan_tasks(
    planner: Planner,
    lengths,
    num_devices: int,
    tasks: tuple,
    *,
    with_baselines: bool,
    limit: float,
    deadline: float,
    time_limit_s: float,
) -> PlannedStep:
    """A step of several tasks (``tasks`` = (task_of, adapter_ranks, method, barrier)): ``plan_task_step`` by
    ``method`` with ``planner``'s MILP for every part's SP plan (the time left shared by the parts,
    :func:`part_plan`; ``time_limit_s`` for a part without a deadline); ``with_baselines``, the tasks in turn with
    the same SP planner in the last ~40 % of the budget ``limit``, for ``baselines_ms['in_turn']``.

    ``predicted_ms`` is ``step_time_ms`` of the plan: micro-batches one after another, each as long as its
    slowest group. That models the waves faithfully only where parts side by side have micro-batches of equal
    time: a barrier between micro-batches charges a long part's one micro-batch beside a short part's several
    as the long one plus all but the first of the short ones, where the workers (no barrier, each rank in plan
    order) overlap them; ``plan.meta['dataflow_ms']`` is that barrier-free time (within a few per cent of
    Spindle's estimate ``makespan_ms`` in our examples), ``plan.meta['bound_ms']`` Spindle's bound C* in its own
    cost model; the step's ``bound_ms`` is 0. Sharded workers (FSDP: every rank runs every micro-batch, world-wide
    collectives per layer) do meet at every micro-batch, where ``predicted_ms`` is the right figure.

    Never worse than the baseline, in the time model the workers run (``barrier``: sharded state, every
    micro-batch a barrier, ``simulated_ms``; else the barrier-free ``dataflow_ms``): when the tasks in turn are
    faster there, the step runs them (status ``spindle-in_turn``, ``plan.meta['note']`` says by how much). Judged
    by the barrier model alone it would undo Spindle's plans exactly where their waves gain most on replicated
    workers (``tests/unit/test_multitask_execute.py`` shows a step both ways;
    ``benchmarks/results/measured/multi_task.md`` a run where the tasks in turn won)."""
    task_of, adapter_ranks, method, barrier = tasks
    profile = planner.profile
    used = {"crashes": 0, "short": 0, "parts": 0}

    def sp(lens, n, due):
        return part_plan(planner, lens, n, due, used, time_limit_s)

    both = with_baselines and method != "in_turn"
    first_due = time.monotonic() + 0.58 * (deadline - time.monotonic()) if both else deadline - 0.02 * limit
    args = (lengths, task_of, num_devices, profile)
    kw = {"adapter_ranks": adapter_ranks, "sp_planner": sp}
    plan, mine = plan_task_step(*args, method=method, deadline=first_due, **kw)
    predicted, baselines = step_time_ms(plan, profile), {}
    status = method
    if both:
        turn, info = plan_task_step(*args, method="in_turn", deadline=deadline - 0.02 * limit, **kw)
        baselines["in_turn"] = info["simulated_ms"]
        plan.meta["in_turn_dataflow_ms"] = info["dataflow_ms"]
        if _turn_is_faster(turn, info, mine, method, barrier):  # never worse than the tasks in turn
            plan, predicted, status = turn, info["simulated_ms"], f"{method}-in_turn"
    elif with_baselines:
        baselines["in_turn"] = predicted
    if uses_auto(profile):  # each group in its recompute mode (each part in its fastest packing)
        predicted = step_time_ms(with_chosen_modes(plan, profile), profile)
    return _task_step(plan, predicted, status, baselines, used, limit)


def _task_step(plan: Plan, predicted: float, status: str, baselines: dict, used: dict, limit: float) -> PlannedStep:
    """The answer of :func:`plan_tasks`: ``bound_ms`` 0, and 'timeout' where some parts ran out of planning time."""
    short = _short_note(used, limit)
    reason = "timeout" if short else None
    return PlannedStep(plan, predicted, status=status, baselines_ms=baselines, fallback_reason=reason,
                       fallback_message=short, solver_crashes=used["crashes"])  # fmt: skip


def _turn_is_faster(turn: Plan, info: dict, mine: dict, method: str, barrier: bool) -> bool:
    """Whether the tasks in turn (``turn``, its ``info``) are faster than ``method``'s plan (its info ``mine``) in the
    time model the workers run (``barrier``: ``simulated_ms``, else ``dataflow_ms``); then ``turn.meta`` says by how
    much."""
    key = "simulated_ms" if barrier else "dataflow_ms"
    if info[key] < mine[key] * (1 - 1e-9):
        turn.meta["note"] = (
            f"tasks in turn: {info[key]:.1f} ms < {method}'s {mine[key]:.1f} ms ({key.removesuffix('_ms')})"
        )
        turn.meta[f"{method}_{key}"] = mine[key]
        return True
    return False


def _short_note(used: dict, limit: float) -> str:
    """Why some task parts did not get a MILP plan ('' when all did)."""
    if not used["short"]:
        return ""
    return (
        f"{used['short']} of {used['parts']} task parts ran out of planning time (plan.time_limit_s="
        f"{limit:g} s) and run their best static layout; raise plan.time_limit_s or give the planner more CPU"
    )


def part_plan(planner: Planner, lengths, n: int, due: float | None, used: dict, time_limit_s: float) -> Plan:
    """One task part's SP plan on n devices by ``due`` (None: ``time_limit_s`` from now): the MILP planner with the
    static layouts (BatchAda) planned while it solves, the better of the two; BatchAda alone when too little time is
    left. Under 'auto' recompute that plan has the first half of the time and the packings for faster modes' bytes
    the rest, and the fastest packing is the part's plan, as in a step of one task."""
    profile: Profile = planner.profile
    due = time.monotonic() + time_limit_s if due is None else due
    used["parts"] += 1
    if due - time.monotonic() < MIN_PART_S:
        used["short"] += 1
        return baseline_plans(lengths, n, profile, deadline=due)["batchada"]
    auto = uses_auto(profile)
    first = time.monotonic() + 0.5 * (due - time.monotonic()) if auto else due
    run = BaselineRun(lengths, n, profile)
    sp = planner.plan(lengths, n, deadline=first - 0.25 * (first - time.monotonic()), idle=run.advance)
    used["crashes"] += sp.solver_crashes
    run.advance(first)
    statics, ms, _ = run.result()
    if sp.out_of_time:
        used["short"] += 1
    plan = statics["batchada"] if ms["batchada"] < sp.predicted_ms else sp.plan
    if not auto:
        return plan
    others, crashes = other_packings(planner, plan, lengths, n, due, min_s=MIN_PART_S)
    used["crashes"] += crashes
    return choose_packing(plan, others, profile)[0]
