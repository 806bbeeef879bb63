"""Spindle's per-step planner for several tasks over one base model (arXiv 2409.03365, §4), pure.

    tasks + N devices + cost-model profile
      -> MetaOps with T_m(n) on n = 1, 2, 4, ... devices          (metaop.py, sp_estimate.py; Spindle §3, §4.1)
      -> continuous allocation: bisection on C, bound C*           (allocation.py; §4.2, Theorem 1)
      -> bi-point pieces, two valid counts per MetaOp              (discretise.py; §4.3)
      -> event-driven wavefront schedule on aligned blocks         (waves.py; §4.3)
      -> MultiTaskPlan (validated), never worse than the baselines (plan.py, baselines.py)

Beyond the paper (``search.py``): the bi-point pieces at C* and at a few larger makespans C*(1 + s) (``slacks``),
and single counts, are allotments a local search chooses from, one MetaOp at a time, each choice priced by the
scheduler; the baselines' allotments are starting points, so the search ends no worse than them. Should a baseline
still be better, the plan is that baseline, with ``method`` and ``note`` saying so.

``split_layers=False``: every MetaOp runs whole, all its layers on one device block (one part per MetaOp; the
baselines are whole already). What workers can execute today (``execute.py``); C* stays a bound (it is one for
the larger set of schedules that may split layers).
"""

from __future__ import annotations

import time

from flexorch.solver.errors import PlanningError
from flexorch.solver.multitask.allocation import continuous_allocation
from flexorch.solver.multitask.baselines import fixed_split_parts, in_turn_parts
from flexorch.solver.multitask.metaop import MetaOp, build_metaops
from flexorch.solver.multitask.plan import MultiTaskPlan, waves_of
from flexorch.solver.multitask.search import search_schedule
from flexorch.solver.profiles import Profile

__all__ = ["SLACKS", "plan_tasks", "plan_metaops"]

SLACKS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.35)
"""Makespans C*(1 + s) whose allocations are discretised and scheduled; the best schedule wins."""


def _makespan(parts) -> float:
    return max(p.end_ms for p in parts)


def plan_metaops(
    metaops,
    num_devices: int,
    *,
    slacks=SLACKS,
    max_evals: int = 1500,
    started: float | None = None,
    split_layers: bool = True,
) -> MultiTaskPlan:
    """Plan given MetaOps (tasks numbered 0..T-1, levels 0..k-1 per task); without `split_layers`, one part per
    MetaOp."""
    started = time.perf_counter() if started is None else started
    metaops: tuple[MetaOp, ...] = tuple(metaops)
    if not isinstance(num_devices, int) or num_devices < 1:
        raise PlanningError(f"the number of devices must be an integer >= 1, got {num_devices!r}")
    top = 1 << (num_devices.bit_length() - 1)
    tasks = sorted({m.task for m in metaops})
    if not metaops or tasks != list(range(len(tasks))):
        raise PlanningError(f"MetaOps must cover tasks 0..T-1, got tasks {tasks}")
    short = [m.name for m in metaops if m.counts[-1] != top]
    if short:
        raise PlanningError(
            f"MetaOps {short} have a time table up to {2 ** (len(metaops[0].layer_ms) - 1)} devices, "
            f"not up to {top} (the largest power of two <= {num_devices})"
        )
    alloc = continuous_allocation(metaops, num_devices)
    makespan, parts, note = search_schedule(metaops, num_devices, alloc.makespan_ms, slacks, max_evals, split_layers)
    best = (makespan, "spindle", parts, note)
    baselines = {"in_turn": in_turn_parts(metaops, num_devices), "fixed_split": fixed_split_parts(metaops, num_devices)}
    baselines_ms = {k: _makespan(p) if p else float("inf") for k, p in baselines.items()}
    for name, parts in baselines.items():
        if parts and baselines_ms[name] < best[0]:
            best = (baselines_ms[name], name, parts, "")
            note = f"fell back to {name}: {baselines_ms[name]:.1f} ms < Spindle's schedule {makespan:.1f} ms"
    return MultiTaskPlan(
        num_devices=num_devices,
        metaops=metaops,
        waves=waves_of(best[2]),
        makespan_ms=best[0],
        bound_ms=alloc.makespan_ms,
        solve_s=time.perf_counter() - started,
        baselines_ms=baselines_ms,
        method=best[1],
        note=note,
    )


def plan_tasks(
    tasks, num_devices: int, profile: Profile, *, slacks=SLACKS, max_evals: int = 1500, split_layers: bool = True
) -> MultiTaskPlan:
    """Spindle's plan for one step of `tasks` (``TaskBatch``) on `num_devices` devices under `profile`; without
    `split_layers`, every MetaOp whole on one block."""
    started = time.perf_counter()
    if not tasks:
        raise PlanningError("plan_tasks needs at least one task")
    return plan_metaops(
        build_metaops(tasks, num_devices, profile),
        num_devices,
        slacks=slacks,
        max_evals=max_evals,
        started=started,
        split_layers=split_layers,
    )
