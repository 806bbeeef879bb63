"""The kinds of step the driver runs, one strategy each: what differs between an SP step and a pipelined step.

* :class:`SpSteps`: the step's micro-batches run one after another, each split into SP groups of different sizes
  (FlexSP, arXiv 2412.01523). A run of ``[[tasks]]`` is its variant, :class:`MultiTaskSteps`: each group runs one
  task's adapter and weighs its loss (Spindle, arXiv 2409.03365).
* :class:`PipelinedSteps`: the batch runs through ``pipeline_stages`` stages of workers, re-chunked every step
  (Seq1F1B, arXiv 2406.03488; InfiniPipe, arXiv 2509.21275).

A strategy owns the four places where the kinds differ: cutting the plan into each rank's work
(``flexorch.work``), what must move before the ranks start (stage-local parameters), how many collective waits a
step holds (the backstop of the settle), and the record fields only that kind has. The driver's step transition
(``control.driver``) is the same for every kind and asks the strategy; the worker side picks its executor from the
work value it receives (``workers.actor.Worker._executor``).
"""

from __future__ import annotations

import enum

from flexorch.config import TrainConfig
from flexorch.control.calibration import model_state_fields
from flexorch.data.task_corpus import multitask_fields, task_fields
from flexorch.solver.profiles import Profile
from flexorch.solver.recompute import recompute_modes
from flexorch.solver.step_planner import PlannedStep
from flexorch.work.pipeline import PipelineWork, pipeline_work
from flexorch.work.step import step_work

__all__ = ["MultiTaskSteps", "PipelinedSteps", "SpSteps", "StepKind", "step_kinds"]


class StepKind(enum.Enum):
    """The kind of step a plan is: the name its strategy is found by in :func:`step_kinds`."""

    SP = "sp"
    PIPELINED = "pipelined"

    @classmethod
    def of(cls, planned: PlannedStep) -> StepKind:
        """The kind of step ``planned`` runs as (the planner decides: a pipelined plan or SP groups)."""
        return cls.PIPELINED if planned.pipelined else cls.SP


class SpSteps:
    """SP steps: each rank's SP groups per micro-batch, with each group's 'auto' recompute mode."""

    refits = True
    """The cost model's refit learns from these steps' measured groups (``control.profile_revisions``)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg

    def rank_work(self, planned: PlannedStep, docs, step_no: int, profile: Profile | None, base: dict) -> list:
        """One :class:`~flexorch.work.step.StepWork` per rank; the groups' recompute modes go into ``base``."""
        modes = recompute_modes(planned.plan, profile)  # 'auto' recompute: each group's mode
        if modes is not None:
            base["recompute"] = [list(row) for row in modes]
            if "recompute_packing" in planned.plan.meta:
                base["recompute_packing"] = dict(planned.plan.meta["recompute_packing"])
        names, weights = tuple(t.name for t in self.cfg.tasks), tuple(t.weight for t in self.cfg.tasks)
        return step_work(planned.plan, docs, step_no, modes, names, weights)

    def before_start(self, work: list, workers) -> dict | None:
        """Nothing moves before an SP step: every rank holds the whole model, or its FSDP shards."""
        return None

    def waits(self, planned: PlannedStep) -> int:
        """Collective waits a rank may hold in the step: one gradient sync per micro-batch at most."""
        return len(planned.plan.micro_batches)

    def add_fields(self, record: dict, planned: PlannedStep, docs, moved: dict | None, task_epochs) -> None:
        """The SP step's own record fields: the model state each worker held in the run's sharding mode."""
        record["model_state"] = model_state_fields(self.cfg, record["world_size"])


class MultiTaskSteps(SpSteps):
    """SP steps of a run of ``[[tasks]]``: each group runs one task; the record says each task's share and loss."""

    def add_fields(self, record: dict, planned: PlannedStep, docs, moved: dict | None, task_epochs) -> None:
        record["tasks"] = task_fields(self.cfg.tasks, docs, record.get("task_losses", {}), task_epochs)
        record["multitask"] = multitask_fields(planned.plan)
        super().add_fields(record, planned, docs, moved, task_epochs)


class PipelinedSteps:
    """Pipelined steps: each rank's stage and its ops; stage-local parameters move to their stage first."""

    refits = False
    """The refit fits SP groups; a pipelined step's time is the pipeline simulator's makespan."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        # sharded state: each stage's parts are FSDP units over its workers, never moved as whole parts
        self.stage_params = cfg.pipeline.params == "stage" and cfg.sharding_mode == "replicate"

    def rank_work(self, planned: PlannedStep, docs, step_no: int, profile, base: dict) -> list[PipelineWork]:
        """One :class:`~flexorch.work.pipeline.PipelineWork` per rank (ranks beyond the stages run none)."""
        return pipeline_work(
            planned.plan, docs, step_no, stage_params=self.stage_params, tied=self.cfg.model.tie_embeddings
        )

    def before_start(self, work: list[PipelineWork], workers) -> dict | None:
        """Move stage-local parameters to the ranks whose stage runs them; what moved (None: nothing to place).
        Raises ``control.failures.MembershipFailure`` when a worker dies while they move."""
        if not work[0].stage_params:
            return None
        return workers.place_params(work[0].held_parts())

    def waits(self, planned: PlannedStep) -> int:
        """Collective waits a rank may hold: a send and a receive per unit of the pipeline."""
        return 2 * len(planned.plan.units)

    def add_fields(self, record: dict, planned: PlannedStep, docs, moved: dict | None, task_epochs) -> None:
        """Where the stage-local parameters were and what moved (the ``pipeline`` field comes with the plan)."""
        if moved is not None:
            record["pipeline"]["params"] = {"placement": self.cfg.pipeline.params, **moved}


def step_kinds(cfg: TrainConfig) -> dict[StepKind, SpSteps | PipelinedSteps]:
    """The run's strategies keyed by :class:`StepKind` (``StepKind.of(planned)``): the pipelined one, and the SP one
    (multi-task SP with ``[[tasks]]``). The plan decides which runs a step, so a plan of either kind is run by its
    own strategy."""
    return {
        StepKind.PIPELINED: PipelinedSteps(cfg),
        StepKind.SP: MultiTaskSteps(cfg) if cfg.tasks else SpSteps(cfg),
    }
