"""Planning, pure: lengths + devices + cost-model profile in, a frozen `Plan` out (no Ray, no torch.distributed).

from flexorch.solver import PlannerConfig, StepPlanner, get_profile
with StepPlanner(get_profile("gpt-7b-a100"), PlannerConfig()) as planner:
    result = planner.plan([4096, 300, 120_000, ...], num_devices=64)
result.plan           # validated Plan: micro-batches of SP groups, every sequence exactly once
result.predicted_ms   # predicted step time (cost model, real lengths), never above BatchAda's
result.bound_ms       # proven lower bound on any plan's step time
result.baselines_ms   # the static layouts' and BatchAda's predicted step times

:class:`StepPlanner` (``pipeline_stages=P`` plans pipelines instead) and its :class:`PlannedStep` are the one
planning path of `flexorch plan` and `flexorch train`; :func:`plan_step` is the inner MILP planner alone.
"""

# Names load on first use (PEP 562), so importing one module of the solver (say the stage-count rule, which the
# config checks with) does not pull in the MILP planner and python-mip.
import importlib

_WHERE = {
    "BUILTIN_PROFILES": "flexorch.solver.profiles",
    "CommSample": "flexorch.solver.calibration",
    "ComputeSample": "flexorch.solver.calibration",
    "FitReport": "flexorch.solver.calibration",
    "Group": "flexorch.solver.plan",
    "GroupSample": "flexorch.solver.calibration",
    "InfeasibleBatchError": "flexorch.solver.errors",
    "InvalidPlanError": "flexorch.solver.errors",
    "MicroBatch": "flexorch.solver.plan",
    "Plan": "flexorch.solver.plan",
    "PlannedStep": "flexorch.solver.planned_step",
    "Planner": "flexorch.solver.planner",
    "PlannerConfig": "flexorch.solver.planner_config",
    "PlanningError": "flexorch.solver.errors",
    "Profile": "flexorch.solver.profiles",
    "ProfileError": "flexorch.solver.errors",
    "RING": "flexorch.solver.cost_model",
    "StepPlanner": "flexorch.solver.step_planner",
    "ULYSSES": "flexorch.solver.cost_model",
    "baseline_plans": "flexorch.solver.baselines",
    "baseline_times_ms": "flexorch.solver.baselines",
    "fit_profile": "flexorch.solver.calibration",
    "get_profile": "flexorch.solver.profiles",
    "load_profile": "flexorch.solver.profiles",
    "micro_batch_times_ms": "flexorch.solver.simulator",
    "min_degree": "flexorch.solver.cost_model",
    "plan_step": "flexorch.solver.planner",
    "prediction_errors": "flexorch.solver.calibration",
    "seq_time_ms": "flexorch.solver.cost_model",
    "static_plan": "flexorch.solver.baselines",
    "step_time_ms": "flexorch.solver.simulator",
}


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = [
    "BUILTIN_PROFILES",
    "CommSample",
    "ComputeSample",
    "FitReport",
    "GroupSample",
    "Group",
    "InfeasibleBatchError",
    "InvalidPlanError",
    "MicroBatch",
    "Plan",
    "Planner",
    "PlannerConfig",
    "PlanningError",
    "Profile",
    "ProfileError",
    "RING",
    "PlannedStep",
    "StepPlanner",
    "ULYSSES",
    "baseline_plans",
    "baseline_times_ms",
    "fit_profile",
    "get_profile",
    "load_profile",
    "micro_batch_times_ms",
    "min_degree",
    "plan_step",
    "prediction_errors",
    "seq_time_ms",
    "static_plan",
    "step_time_ms",
]
