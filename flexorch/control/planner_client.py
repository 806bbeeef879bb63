"""The planner actor the driver talks to: a :class:`~flexorch.solver.step_planner.StepPlanner` in its own process,
so the next batch's solve overlaps the current step."""

from __future__ import annotations

import ray

from flexorch.solver.step_planner import StepPlanner

__all__ = ["StepPlannerActor"]

StepPlannerActor = ray.remote(num_cpus=0, max_restarts=5, max_task_retries=2)(StepPlanner)
"""``StepPlanner`` in its own worker process (no CPU reserved: it sleeps while the step runs). CBC can crash on
rare models (coin-or/Cbc#687, python-mip#139); Ray then restarts the actor and retries the plan call."""
