"""A pipelined step for the workers alive now: which ranks form which stage, and the step's pipeline plan.

``pipeline_stages = P`` puts ``d = n // P`` workers on each stage (SP inside a stage, Ulysses); stage r is ranks
``[r*d, (r+1)*d)`` and the ``n - P*d`` ranks left over sit the step out (they still take part in the gradient
all-reduce and keep a replica, so they are ready when the next membership change needs them).
``pipeline_stages = "auto"`` tries every power-of-two split (``flexorch.solver.pipeline.plan.plan_best_layout``).
Because
this runs every step for the ranks alive now, a worker lost or joined changes the stage mapping at the next plan:
nothing else is kept per stage.

:meth:`StagedPlan.to_dict` is the ``pipeline`` section of a step record (``flexorch.records.schema``).
"""

from __future__ import annotations

from dataclasses import dataclass

from flexorch.solver.errors import InfeasibleBatchError, InvalidPlanError
from flexorch.solver.pipeline.plan import (
    PipelinePlan,
    packed_1f1b_units,
    plan_best_layout,
    plan_fully_checkpointed,
    plan_pipeline,
    plan_units,
)
from flexorch.solver.pipeline.plan import seq1f1b_units as _seq1f1b_units
from flexorch.solver.pipeline.stage_count import auto_stage_layouts, check_stage_count
from flexorch.solver.pipeline.stage_model import StageModel, stage_layers
from flexorch.solver.profiles import Profile

__all__ = [
    "StagedPlan",
    "plan_staged",
    "fallback_staged",
    "pipeline_baselines",
]


@dataclass(frozen=True)
class StagedPlan:
    """A pipeline plan mapped onto the ranks alive; checks its shape on construction, as ``Plan`` does."""

    plan: PipelinePlan
    degree: int
    """Workers per stage."""
    num_devices: int
    """Ranks in the world (``stages * degree`` of them run stages)."""
    layers: tuple[int, ...]
    """Decoder layers of each stage."""

    def __post_init__(self) -> None:
        p, d, n = self.plan.stages, self.degree, self.num_devices
        for name, v in (("stages", p), ("degree", d), ("num_devices", n)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidPlanError(f"staged plan: {name} must be an integer >= 1, got {v!r}")
        if p * d > n:
            raise InvalidPlanError(f"staged plan: {p} stages of {d} ranks need {p * d} ranks, the world has {n}")
        if len(self.layers) != p or any(not isinstance(x, int) or x < 1 for x in self.layers):
            raise InvalidPlanError(f"staged plan: layers {self.layers} must be {p} counts >= 1, one per stage")
        if not self.plan.pipelines:
            raise InvalidPlanError("staged plan: the pipeline plan holds no pipeline")
        for i, pipe in enumerate(self.plan.pipelines):
            if len(pipe.schedule) != p or len(pipe.checkpointed) != p:
                raise InvalidPlanError(
                    f"staged plan: pipeline {i} has {len(pipe.schedule)} op lists and {len(pipe.checkpointed)} "
                    f"checkpointing rows for {p} stages"
                )
            for r, row in enumerate(pipe.checkpointed):
                if len(row) != len(pipe.units) or any(not 0 <= c <= self.layers[r] for c in row):
                    raise InvalidPlanError(
                        f"staged plan: pipeline {i}, stage {r}: checkpointed {tuple(row)} must be {len(pipe.units)} "
                        f"counts in 0..{self.layers[r]} (its layers), one per unit"
                    )

    @property
    def stages(self) -> int:
        return self.plan.stages

    @property
    def stage_ranks(self) -> tuple[tuple[int, ...], ...]:
        d = self.degree
        return tuple(tuple(range(r * d, (r + 1) * d)) for r in range(self.stages))

    @property
    def makespan_ms(self) -> float:
        return self.plan.makespan_ms

    @property
    def units(self) -> list:
        """Every pipeline's units, in order (what the stages send and receive, one activation each way)."""
        return self.plan.units

    def shape(self) -> str:
        b2b = f" · {len(self.plan.pipelines)} back-to-back" if len(self.plan.pipelines) > 1 else ""
        return f"pp {self.stages}x{self.degree} · {len(self.plan.units)} units{b2b}"

    def to_dict(self) -> dict:
        units, ckpt, ops = [], [[] for _ in range(self.stages)], []
        offset_ms, base = 0.0, 0
        for pi, pipe in enumerate(self.plan.pipelines):
            for u in pipe.units:
                units.append(
                    {
                        "chain": u.chain,
                        "pipeline": pi,
                        "tokens": u.tokens,
                        "pieces": [[p.seq, p.start, p.end] for p in u.pieces],
                    }
                )
            for r in range(self.stages):
                ckpt[r] += list(pipe.checkpointed[r])
            for t in pipe.run.timings:
                ops.append(
                    {
                        "stage": t.stage,
                        "kind": t.op.kind,
                        "unit": base + t.op.unit,
                        "start_ms": offset_ms + t.start_ms,
                        "end_ms": offset_ms + t.end_ms,
                    }
                )
            offset_ms += pipe.run.makespan_ms
            base += len(pipe.units)
        return {
            "stages": self.stages,
            "degree": self.degree,
            "layers": list(self.layers),
            "stage_ranks": [list(rs) for rs in self.stage_ranks],
            "granularity": self.plan.granularity,
            "bubble_share": self.plan.bubble_share,
            "peak_bytes": list(self.plan.peak_bytes),
            "units": units,
            "checkpointed": ckpt,
            "ops": ops,
        }


def plan_staged(
    lengths, num_devices: int, profile: Profile, stages: int | str, *, time_limit_s: float = 1.0, recompute="auto"
) -> StagedPlan:
    """The step's pipeline plan on ``num_devices`` ranks: ``stages`` fixed (``d = n // stages`` per stage) or
    ``"auto"`` (the fastest simulated split whose degree divides the heads), recomputing as ``recompute`` says
    (``StageModel.recompute``). Raises InfeasibleBatchError when no checkpointing it allows lets the batch fit."""
    alive = f"{num_devices} are alive"
    check_stage_count(stages, num_devices, profile.num_layers, profile.num_heads, have=alive)
    try:
        if stages == "auto":
            layouts = auto_stage_layouts(num_devices, profile.num_layers, profile.num_heads)
            plan, p, d = plan_best_layout(
                lengths, num_devices, profile, time_limit_s=time_limit_s, layouts=layouts, recompute=recompute
            )
        else:
            p, d = stages, num_devices // stages
            plan = plan_pipeline(lengths, p, profile, degree=d, time_limit_s=time_limit_s, recompute=recompute)
    except ValueError as e:
        if isinstance(e, InfeasibleBatchError):
            raise
        raise InfeasibleBatchError(str(e)) from None
    return StagedPlan(plan, d, num_devices, tuple(stage_layers(profile.num_layers, p)))


def fallback_staged(lengths, num_devices: int, profile: Profile, stages: int | str, recompute="auto") -> StagedPlan:
    """Without any MILP (the planner actor is stuck): ``stages`` (2 for 'auto') stages, granularity P, every layer
    checkpointed, none under ``recompute`` 'none' (``flexorch.solver.pipeline.plan.plan_fully_checkpointed``)."""
    p = 2 if stages == "auto" else stages
    check_stage_count(p, num_devices, profile.num_layers, profile.num_heads, have=f"{num_devices} are alive")
    d = num_devices // p
    try:
        plan = plan_fully_checkpointed(lengths, p, profile, degree=d, recompute=recompute)
    except ValueError as e:
        raise InfeasibleBatchError(str(e)) from None
    return StagedPlan(plan, d, num_devices, tuple(stage_layers(profile.num_layers, p)))


def pipeline_baselines(
    lengths, staged: StagedPlan, profile: Profile, *, k: int = 4, time_limit_s: float = 1.0, recompute="auto"
) -> dict[str, PipelinePlan | None]:
    """The step's baselines on the same stages: plain 1F1B (packed micro-batches, no splitting) and Seq1F1B (those
    micro-batches in k equal-FLOP segments each), each with the fastest of P, 2P and 4P micro-batches and the same
    checkpointing ILP (or ``recompute``'s one choice); None where no micro-batch count fits."""
    model = StageModel(profile, staged.stages, staged.degree, recompute)
    p = staged.stages
    out: dict[str, PipelinePlan | None] = {}
    for name, make in (
        ("1f1b", lambda m: packed_1f1b_units(lengths, m, profile.a1_ms, profile.a2_ms)),
        (f"seq1f1b-{k}", lambda m: _seq1f1b_units(lengths, m, k, profile.a1_ms, profile.a2_ms)),
    ):
        best = None
        for m in sorted({min(f * p, len(lengths)) for f in (1, 2, 4)}):
            try:
                plan = plan_units(model, make(m), m, time_limit_s)
            except ValueError:
                continue
            if best is None or plan.makespan_ms < best.makespan_ms:
                best = plan
        out[name] = best
    return out
