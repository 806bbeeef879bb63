"""The one plan result: a plan and how it was found (or why there is none).

Each layer of planning adds to the same value rather than wrapping it: the MILP planner
(:class:`~flexorch.solver.planner.Planner`) makes it with its plan, bound, status and ``details``; the adaptive step
(``solver.adaptive_step``) replaces the plan where the BatchAda floor wins, adds the baselines and the reason a plan
ran out of time; the step planner (:class:`~flexorch.solver.step_planner.StepPlanner`) adds the time and budget the
whole call took and the profile revision; the driver's planner client (``flexorch.control.planner_client``) marks
its own MILP-free plan ``heuristic`` and says why it was used. Each addition is ``dataclasses.replace``.

Two kinds of plan carry the status ``'fallback'`` (the status string the step records have always had for both),
told apart by :attr:`PlannedStep.heuristic`:

* :data:`OUT_OF_TIME`: the MILP planner ran out of time before any candidate split was solved or packed (the
  homogeneous starts stand; :attr:`PlannedStep.out_of_time`);
* :data:`HEURISTIC`: :func:`~flexorch.solver.step_planner.heuristic_plan`, the MILP-free plan the planner client runs
  when it gets no plan from the planner (``heuristic`` is True).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from flexorch.solver.pipeline.staged import StagedPlan
from flexorch.solver.plan import Plan

__all__ = ["HEURISTIC", "OUT_OF_TIME", "PlannedStep"]

OUT_OF_TIME = "fallback"
"""Status of a MILP planner's plan made when time ran out before any candidate split was solved or packed."""
HEURISTIC = "fallback"
"""Status of the planner client's MILP-free plan (``heuristic_plan``); the same string as :data:`OUT_OF_TIME` in the
step records, told apart by :attr:`PlannedStep.heuristic`."""


@dataclass(frozen=True)
class PlannedStep:
    """A plan and how it was found (or why there is none): the one solve result that the planner makes, the step
    planner completes and `flexorch plan`, the train driver and the step records read. Checks itself on
    construction (it crosses the planner actor's boundary)."""

    plan: Plan | StagedPlan | None
    """SP groups per micro-batch, or a pipeline over stages (``pipeline_stages``; see :attr:`kind`)."""
    predicted_ms: float = 0.0
    """Step time the cost model predicts for the plan (``solver.simulator``; the pipeline simulator's makespan)."""
    bound_ms: float = 0.0
    """Proven lower bound for this batch (0 where none is computed: static, pipelined and fallback plans)."""
    solve_s: float = 0.0
    status: str = ""
    """How the plan was found: 'milp' (a MILP plan beat the start), 'static' (none did, or none was solved because
    the start was within the tolerance of its bound), :data:`OUT_OF_TIME` / :data:`HEURISTIC` ('fallback'),
    'batchada' (the floor won), 'static-<kind>-<d>', 'pipeline', 'pipeline-<baseline>' (a baseline schedule won),
    'infeasible'; for several tasks the method: 'spindle', 'in_turn', 'fixed_split'."""
    baselines_ms: dict = field(default_factory=dict)
    """Predicted step time of each static layout and BatchAda, or of plain 1F1B and Seq1F1B on the same stages for a
    pipelined step (None where infeasible, or where the time limit left no time to plan that layout: the layouts most
    likely to be the best are planned first, and 'batchada' is the best of those planned)."""
    error: str | None = None
    """Why no plan exists (an infeasible batch); ``plan`` is None then, and only then."""
    fallback_reason: str | None = None
    """Why this step did not get the planner's own plan, or None when it did: 'timeout' (no plan within
    ``plan.timeout_s``, or the planner's budget ran out before any MILP plan), 'crash' (the planner process died),
    'error' (the planner raised), 'infeasible' (no plan fits the batch)."""
    fallback_message: str = ""
    """The reason in words (what happened, what to do), shown in the progress line and the viewer."""
    solver_crashes: int = 0
    """MILP solves that died natively in this plan (each cost that solve, not the plan: ``solver.planner``)."""
    budget_s: float = 0.0
    """The planning budget this plan was given (s): ``time_limit_s``, or in a run the share of the measured step
    time the overlap gives (``PlanSettings.budget_for``); 0 where no planner ran (a fallback)."""
    profile_revision: int = 0
    """The ``Profile.revision`` that priced this plan (its ``predicted_ms``): a refit taken up while it was solved
    does not price it."""
    heuristic: bool = False
    """The planner client's MILP-free plan (:data:`HEURISTIC`), not the planner's own; not written to the records
    (their ``status`` and ``fallback`` say it)."""
    details: dict = field(default_factory=dict)
    """The MILP planner's account of its time: 'time_limit_s', 'used_s', 'solver_crashes', 'solves_cut' (solves
    stopped at the deadline), 'candidates', 'candidates_solved', 'micro_batches', 'methods' (per micro-batch),
    'isolated'; empty where no MILP planner made the plan."""

    @property
    def gap(self) -> float | None:
        """How far the plan may be from the optimum: predicted / bound - 1 (None where no bound is computed)."""
        if self.bound_ms <= 0 or self.plan is None:
            return None
        return max(0.0, self.predicted_ms / self.bound_ms - 1.0)  # the bound is below the plan (checked on creation)

    @property
    def kind(self) -> Literal["sp", "pipelined"]:
        """'pipelined' when :attr:`plan` is a pipeline over stages (a :class:`StagedPlan`), 'sp' for SP groups (or
        none)."""
        return "pipelined" if isinstance(self.plan, StagedPlan) else "sp"

    @property
    def pipelined(self) -> bool:
        """True when :attr:`plan` is a pipeline over stages (a :class:`StagedPlan`), False for SP groups (or none)."""
        return self.kind == "pipelined"

    @property
    def out_of_time(self) -> bool:
        """The MILP planner ran out of time before any candidate split was solved or packed (:data:`OUT_OF_TIME`)."""
        return self.status == OUT_OF_TIME and not self.heuristic

    def __post_init__(self) -> None:
        if self.plan is not None and not isinstance(self.plan, Plan | StagedPlan):
            raise TypeError(f"PlannedStep.plan must be a Plan, a StagedPlan or None, got {type(self.plan).__name__}")
        if (self.plan is None) != (self.error is not None):
            raise ValueError(
                f"PlannedStep needs exactly one of a plan and an error, got plan={self.plan is not None} and "
                f"error={self.error!r}"
            )
        if not isinstance(self.status, str) or not self.status:
            raise ValueError(f"PlannedStep.status must name how the plan was found, got {self.status!r}")
        for name in ("predicted_ms", "bound_ms", "solve_s"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"PlannedStep.{name} must be a finite number >= 0, got {v!r}")
        if self.plan is not None and self.bound_ms > self.predicted_ms * (1 + 1e-9) + 1e-9:
            raise ValueError(
                f"PlannedStep: the lower bound {self.bound_ms} ms exceeds the predicted step time "
                f"{self.predicted_ms} ms ({self.status})"
            )
        for name, v in self.baselines_ms.items():
            if v is not None and not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"PlannedStep.baselines_ms[{name!r}] must be None or a finite number >= 0, got {v!r}")
