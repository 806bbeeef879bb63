"""Pipeline stages: the ``[pipeline]`` table of a run file.

Whether a stage count fits the model and the workers is one rule for every command,
``flexorch.solver.pipeline.stage_count.check_stage_count``; :class:`~flexorch.config.run.TrainConfig` applies it.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexorch.config.errors import ConfigError

__all__ = ["PARAM_PLACEMENTS", "PipelineSettings"]

PARAM_PLACEMENTS = ("stage", "replicated")


@dataclass(frozen=True, kw_only=True)
class PipelineSettings:
    """Whether the layers are split over pipeline stages, and where their parameters live."""

    stages: int | str = 1
    """1: every step is planned as SP groups (FlexSP). P >= 2: the model's layers are split over P pipeline stages,
    each a group of ``workers // P`` workers (Ulysses SP inside a stage), and every step runs a 1F1B schedule whose
    units (Seq1F1B segments, InfiniPipe packing) and checkpointing are planned for its batch. 'auto': the fastest
    simulated stages x workers-per-stage split, chosen per step."""
    params: str = "stage"
    """With pipeline stages, where parameters and optimizer state live. 'stage': each worker holds only its stage's
    layers (a stage's share of the model's memory); parts are copied between workers when the stage map changes,
    and a part whose every holder is lost sends the run back to its last checkpoint. 'replicated': every worker
    keeps the whole model (more memory; any single survivor can carry the run on)."""

    def __post_init__(self) -> None:
        p = self.stages
        if p != "auto" and (not isinstance(p, int) or isinstance(p, bool) or p < 1):
            raise ConfigError(f"pipeline.stages must be a positive integer or 'auto', got {p!r}")
        if self.params not in PARAM_PLACEMENTS:
            raise ConfigError(f"pipeline.params must be 'stage' or 'replicated', got {self.params!r}")

    @property
    def pipelined(self) -> bool:
        """More than one stage (or 'auto'): steps run as pipelines, not SP groups."""
        return self.stages != 1
