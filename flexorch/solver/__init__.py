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

from flexorch.solver.baselines import baseline_plans, baseline_times_ms, static_plan
from flexorch.solver.calibration import (
    CommSample,
    ComputeSample,
    FitReport,
    GroupSample,
    fit_profile,
    prediction_errors,
)
from flexorch.solver.cost_model import RING, ULYSSES, min_degree, seq_time_ms
from flexorch.solver.errors import InfeasibleBatchError, InvalidPlanError, PlanningError, ProfileError
from flexorch.solver.plan import Group, MicroBatch, Plan
from flexorch.solver.planner import Planner, PlannerConfig, plan_step
from flexorch.solver.profiles import BUILTIN_PROFILES, Profile, get_profile, load_profile
from flexorch.solver.simulator import micro_batch_times_ms, step_time_ms
from flexorch.solver.step_planner import PlannedStep, StepPlanner

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
