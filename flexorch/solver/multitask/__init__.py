"""Several fine-tuning tasks over one base model in one step: Spindle's planner (arXiv 2409.03365), pure.

from flexorch.solver.multitask import TaskBatch, plan_tasks
plan = plan_tasks([TaskBatch(name="chat", lengths=[...], adapter_rank=16), ...], 64, get_profile("gpt-7b-a100"))
plan.waves, plan.makespan_ms, plan.bound_ms, plan.gap, plan.baselines_ms   # validated MultiTaskPlan
"""

from flexorch.solver.multitask.allocation import Allocation, continuous_allocation, devices_for_time, layer_ms_at
from flexorch.solver.multitask.discretise import Piece, bi_point
from flexorch.solver.multitask.metaop import MetaOp, TaskBatch, build_metaops
from flexorch.solver.multitask.plan import MultiTaskPlan, Part, Wave
from flexorch.solver.multitask.planner import plan_metaops, plan_tasks

__all__ = [
    "Allocation",
    "MetaOp",
    "MultiTaskPlan",
    "Part",
    "Piece",
    "TaskBatch",
    "Wave",
    "bi_point",
    "build_metaops",
    "continuous_allocation",
    "devices_for_time",
    "layer_ms_at",
    "plan_metaops",
    "plan_tasks",
]
