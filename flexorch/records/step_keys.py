"""The keys of a step record (``flexorch.step/4``), their types and what each means: the pydantic models
:func:`flexorch.records.schema.validate_record` validates a record with (:func:`record_json_schema`: their JSON
Schema).

A record is a plain dict (what ``steps.jsonl`` holds); these models check it and document it, and are never
written. Every model allows keys it does not name, so a reader takes records that carry more than it knows. Times
are milliseconds unless a name ends in ``_s``; "null" is JSON's null (Python's None).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator, model_validator, with_config
from pydantic_core import PydanticCustomError
from typing_extensions import TypedDict

__all__ = ["DRAIN_KEYS", "FALLBACK_REASONS", "RECOMPUTE_MODES", "PlanRecord", "TrainRecord", "record_json_schema"]

FALLBACK_REASONS = ("timeout", "crash", "error", "infeasible")
RECOMPUTE_MODES = ("none", "selective", "full")
DRAIN_KEYS = ("node", "reason", "deadline", "seen_at", "fallback")
LEFT_KEYS = ("handoff_ms", "handoff_bytes", "reform_ms", "recovery_ms")
"""The figures of a drain whose workers left."""

Ms = Annotated[float, Field(description="milliseconds")]
Bytes = Annotated[float, Field(ge=0, description="bytes")]
Kind = Literal["F", "B"]
"""A pipeline op: a unit's forward or backward on one stage."""


STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
"""How every object of a record is checked: strict types (no coercion: ``"3"`` is not an integer, ``true`` not a
number), finite numbers, keys it does not name allowed (and not kept: the record is the dict it was)."""


class Keys(BaseModel):
    """A JSON object of a step record. The objects a record holds one of per rank, group or unit are TypedDicts
    instead: pydantic validates those without building an object for each."""

    model_config = STRICT


def _says(text: str) -> WrapValidator:
    """A field whose error is ``text`` (and the value found) instead of pydantic's."""

    def check(value, handler):
        try:
            return handler(value)
        except ValidationError:
            got = {"text": text, "value": f"{value!r:.80}"}
            raise PydanticCustomError("record", "{text}, got {value}", got) from None

    return WrapValidator(check)


@with_config(STRICT)
class Group(TypedDict):
    """One SP group of a micro-batch: ``degree`` ranks run ``seq_ids`` together."""

    degree: Annotated[int, Field(ge=1, description="workers in the group (its sequence-parallel degree)")]
    kind: Annotated[str, Field(description="the attention's SP kind: 'ring', 'ulysses', ...")]
    ranks: Annotated[list[int], Field(description="the group's world ranks, ``degree`` of them, in [0, world_size)")]
    seq_ids: Annotated[list[int], Field(description="the group's sequences: indices into the record's ``seq_lengths``")]
    seq_lengths: Annotated[list[int], Field(description="their lengths in tokens")]


class Plan(Keys):
    """An SP plan: micro-batches run one after the other, the groups of one micro-batch side by side."""

    num_devices: int = Field(description="workers planned for: the record's ``world_size``")
    micro_batches: list[Annotated[list[Group], Field(min_length=1)]] = Field(
        description="each micro-batch's groups; every sequence of the batch in exactly one group"
    )


@with_config(STRICT)
class TimelineEntry(TypedDict):
    """When the cost model has one group of the plan start, and for how long it runs."""

    micro_batch: Annotated[int, Field(description="index into ``plan.micro_batches``")]
    group: Annotated[int, Field(description="index into that micro-batch's groups")]
    start_ms: Ms
    time_ms: Ms


class StageParams(Keys):
    """Where a pipelined step's parameters live (``[pipeline] params``) and what moved before the step."""

    placement: Literal["stage", "replicated"] = Field(description="each stage holds its layers, or every rank all")
    moved_parts: float = Field(ge=0, description="model parts copied between workers because the stage map changed")
    moved_bytes: Bytes = Field(description="their parameters and optimizer state")
    move_ms: float = Field(ge=0, description="time the copies took")


@with_config(STRICT)
class Unit(TypedDict):
    """A pipeline unit: pieces of sequences that run through the stages together."""

    chain: Annotated[int, Field(description="the chain of units it belongs to")]
    pipeline: Annotated[int, Field(description="the back-to-back pipeline it runs in")]
    tokens: Annotated[int, Field(description="tokens in its pieces")]
    pieces: NotRequired[
        Annotated[
            list[Annotated[list[int], Field(min_length=3, max_length=3)]],
            Field(description="``[seq_id, start, end]`` each: every token of every sequence in exactly one piece"),
        ]
    ]


@with_config(STRICT)
class PipelineOp(TypedDict):
    """One op of the simulated pipeline schedule."""

    stage: int
    kind: Kind
    unit: Annotated[int, Field(description="index into ``pipeline.units``")]
    start_ms: Ms
    end_ms: Ms


class Pipeline(Keys):
    """A pipelined step (``[pipeline] stages`` set): its stages, units and simulated schedule."""

    stages: int = Field(description="pipeline stages")
    degree: int = Field(description="workers per stage (sequence parallel inside a stage)")
    layers: list[int] = Field(description="decoder layers of each stage")
    stage_ranks: list[list[int]] = Field(description="the world ranks of each stage, ``degree`` distinct ranks each")
    granularity: int = Field(description="the planner's unit granularity")
    bubble_share: float = Field(description="the simulated schedule's idle share")
    peak_bytes: list[float] = Field(description="predicted activation bytes of each stage")
    units: list[Unit] = Field(description="the units, numbered across back-to-back pipelines")
    checkpointed: list[list[int]] = Field(description="``[stage][unit]``: layers run under activation checkpointing")
    ops: list[PipelineOp] = Field(description="the simulated schedule: one F and one B per unit and stage")
    params: StageParams | None = Field(default=None, description="trained steps with ``[pipeline] params``")


class Fallback(Keys):
    """Why the step did not get the planner's own plan."""

    reason: Literal[FALLBACK_REASONS] = Field(
        description="'timeout': the planner gave nothing in time, or its budget ran out before any MILP plan; "
        "'crash': the planner process died; 'error': the planner raised; 'infeasible': no plan fits, nothing ran"
    )
    message: str = Field(description="what the user is told")


class RecomputePacking(Keys):
    """With ``activation_checkpointing = "auto"``: the packings the planner compared and the one that ran."""

    packing: Literal["full", "none", "selective"] = Field(
        description="the packing that ran: micro-batches packed for that recompute mode's bytes"
    )
    full_ms: float | None = Field(
        description="the predicted step time of full's packing (each group in the fastest mode that fits)"
    )
    none_ms: float | None = Field(
        default=None,
        description="of none's packing (null: planned, no plan came of it; "
        "absent: not planned, no group of full's packing needed it)",
    )
    selective_ms: float | None = Field(default=None, description="of selective's packing, as ``none_ms``")

    def chosen_ms(self) -> float | None:
        """The predicted step time of the packing that ran: the ``<packing>_ms`` key ``packing`` names."""
        return {"full": self.full_ms, "none": self.none_ms, "selective": self.selective_ms}[self.packing]

    @model_validator(mode="after")
    def _ran_was_priced(self):
        if self.chosen_ms() is None:
            raise ValueError(f"the packing that ran, {self.packing!r}, needs a number in '{self.packing}_ms'")
        return self


@with_config(STRICT)
class RankOp(TypedDict):
    """One op a pipeline rank ran, as measured, from the rank's step start."""

    kind: Kind
    unit: Annotated[int, Field(description="index into ``pipeline.units``")]
    start_ms: Annotated[float, Field(description="when the op's input had arrived")]
    end_ms: Ms
    wait_ms: NotRequired[Annotated[float | None, Field(ge=0, description="how long the rank waited for the input")]]


@with_config(STRICT)
class RankEntry(TypedDict, total=False):
    """What one rank measured in a trained step."""

    micro_batch_ms: Annotated[
        list[float | None],
        Field(description="its group's time in each micro-batch (null: it sat one out); empty when pipelined"),
    ]
    micro_batch_start_ms: Annotated[list[float | None], Field(description="when each began, from the step start")]
    wait_ms: Annotated[
        list[float | None],
        Field(
            description="of each micro-batch's time, what it spent blocked in its group's collectives, waiting for "
            "the others (CPU workers, replicated model only; ``flexorch.workers.attention.collective_waits``)"
        ),
    ]
    compute_end_ms: Annotated[float | None, Field(description="end of its last micro-batch or op")]
    local_tokens: Annotated[int | None, Field(description="tokens it computed")]
    peak_local_tokens: Annotated[int | None, Field(description="most tokens it held at once")]
    peak_activation_bytes: Annotated[float | None, Field(description="its activations' peak")]
    state_bytes: Annotated[
        float | None, Field(description="model state held (parameters, gradients, optimizer state; FSDP: its shards)")
    ]
    param_bytes: Annotated[float | None, Field(description="pipelined: the model state its stage held")]
    compile_s: Annotated[float | None, Field(description="seconds ``torch.compile`` ran on it this step")]
    ops: Annotated[
        list[RankOp] | None,
        Field(description="pipelined: its ops in the order it ran them (empty for a rank no stage uses)"),
    ]
    speed: Annotated[
        float | None,
        Field(
            gt=0,
            description="its worker's speed relative to the others after this step (1.0: the median worker's; "
            "``flexorch.solver.worker_speeds``), 3 decimals",
        ),
    ]
    node: Annotated[
        str | None, Field(description="the node its worker ran on (address, else Ray node id; null: unknown)")
    ]
    pid: Annotated[int | None, Field(ge=0, description="its worker's process id on that node (null: unknown)")]


class Drain(Keys):
    """A node being drained (a preemption notice, ``ray drain-node``): on a ``drain`` recovery, or under ``drain``
    on a loss of workers whose node was being drained. Each of its keys must be there, null or not."""

    node: Any = Field(default=None, description="the node's Ray id")
    node_ip: Any = Field(default=None, description="its address")
    reason: Any = Field(default=None, description="the drain's reason")
    deadline: Annotated[float | None, _says("drain 'deadline' must be null or unix seconds")] = Field(
        default=None, description="unix seconds it goes away (null: none given)"
    )
    seen_at: Annotated[float | None, _says("drain 'seen_at' must be null or unix seconds")] = Field(
        default=None, description="unix seconds the driver first saw the drain"
    )
    fallback: Any = Field(default=None, description="why its workers did not leave ahead of it (null: they did)")

    def is_drain(self) -> bool:
        return True

    @model_validator(mode="after")
    def _all_keys(self):
        missing = [k for k in DRAIN_KEYS if k not in self.model_fields_set] if self.is_drain() else []
        if missing:
            raise ValueError(f"a drain lacks {', '.join(missing)}")
        return self


class Recovery(Drain):
    """A membership change made for the step. After a failure: ``attempt``, ``decisions``, ``lost``, ``reason``,
    ``step_completed``; workers joining: ``joined`` (and ``capacity_wait_s``); a roll-back: ``rollback``,
    ``from_step``, ``to_step``, ``lost``, ``reason``; ``what == "drain"``: the :class:`Drain` keys, ``workers``
    and ``left`` (empty when they stayed: then ``fallback`` says why), ``handoff_ms``, ``handoff_bytes``,
    ``reform_ms``, ``deadline_left_s``, ``after_step``, ``needed_s``."""

    what: Any = Field(default=None, description="'drain', 'grow', the step that failed, ...")
    world_before: Any = Field(default=None, description="the worker ids before")
    world_after: Any = Field(default=None, description="and after")
    recovery_ms: Any = Field(default=None, description="time the change took")
    drain: Drain | None = Field(
        default=None, description="a loss on a draining node: the drain and why its workers had not left"
    )
    out_of_memory: Any = Field(
        default=None,
        description="a worker ran out of device memory: ``workers``, the "
        "activation budget before and after the cut, and each worker's first error line",
    )
    workers: list[Any] | None = Field(default=None, description="drain: the node's workers")
    left: list[Any] | None = Field(default=None, description="drain: the workers that left at this boundary")
    handoff_ms: Any = Field(default=None, description="drain: time handing the stayers what the leavers held")
    handoff_bytes: Any = Field(default=None, description="drain: the bytes handed over")
    reform_ms: Any = Field(
        default=None,
        description="drain: time forming the new world (``reform_phases_ms``: the slowest member's phases)",
    )

    def is_drain(self) -> bool:
        return self.what == "drain"

    @model_validator(mode="after")
    def _left_or_why(self):
        """A drain's workers either left at this boundary (``left``, its figures >= 0, no ``fallback``) or stayed
        for the lost-node path (``left`` empty, ``fallback`` says why)."""
        if not self.is_drain():
            return self
        if not isinstance(self.left, list) or not isinstance(self.workers, list):
            raise ValueError("a drain needs 'workers' and 'left' (lists of worker ids)")
        if self.fallback is None:
            figures = [getattr(self, k) for k in LEFT_KEYS]
            if not self.left or any(not isinstance(v, int | float) or v < 0 for v in figures):
                raise ValueError(f"a drain its workers left needs 'left' and {', '.join(LEFT_KEYS)} >= 0")
        elif not isinstance(self.fallback, str) or self.left:
            raise ValueError("a drain's 'fallback' says why its workers stayed ('left' empty)")
        return self


class PlanRecord(Keys):
    """A planned step: the keys of every record (``source`` ``"plan"``, `flexorch plan`)."""

    schema_: str = Field(alias="schema", description="this schema's version, ``flexorch.step/4``")
    source: Literal["plan", "train"] = Field(description="'plan' (`flexorch plan`) or 'train' (`flexorch train`)")
    step: int = Field(description="0-based")
    time: float = Field(description="unix seconds when written")
    epoch: int = Field(description="pass over the data")
    world_size: int = Field(description="devices or workers planned for")
    seq_lengths: list[int] = Field(description="tokens of each sequence of the batch, in batch order")
    tokens: int = Field(description="next-token predictions of the batch: the sum of ``length - 1``")
    status: str = Field(description="how the plan was found (the module docstring of `flexorch.records.schema`)")
    skipped: bool = Field(description="no plan fits: nothing ran")
    reason: str | None = Field(description="why it was skipped")
    mode: str = Field(description="the planner's mode")
    shape: str | None = Field(description="e.g. '<4, 2x2> | <8>' or 'pp 2x2 · 12 units'; null when skipped")
    plan: Plan | None = Field(description="the SP plan; null when skipped or pipelined")
    timeline: list[TimelineEntry] | None = Field(
        description="the cost model's schedule of ``plan``, one entry per group"
    )
    solve_s: float = Field(description="seconds the planner took")
    predicted_ms: float | None = Field(description="the plan's predicted step time; null when skipped")
    bound_ms: float = Field(description="a proven lower bound on the step time; 0 when none")
    baselines_ms: dict[str, float | None] = Field(
        description="predicted step time of each static layout and BatchAda (null: the layout cannot hold the batch)"
    )
    pipeline: Pipeline | None = Field(description="the pipelined step; null unless it ran on pipeline stages")
    fallback: Annotated[
        Fallback | None,
        _says(f"'fallback' must be null or {{'reason': one of {list(FALLBACK_REASONS)}, 'message': str}}"),
    ] = Field(default=None, description="why the step did not get the planner's own plan (null: it did)")
    solver_crashes: int = Field(default=0, ge=0, description="MILP solves that died natively while planning it")
    plan_budget_s: float | None = Field(default=None, ge=0, description="the planning budget the plan was given")
    gap: float | None = Field(
        default=None,
        ge=0,
        description="``predicted_ms / bound_ms - 1``: how far from the optimum the plan can be (null without a bound)",
    )
    profile_revision: int | None = Field(
        default=None,
        description="the version of the run's cost model that "
        "priced the plan (0 as calibrated, +1 per refit taken up or rolled back)",
    )
    level: float | None = Field(
        default=None,
        gt=0,
        description="the run's step level (``flexorch.solver.step_level``) the plan's prices (``predicted_ms``, "
        "``bound_ms``, ``baselines_ms``, the timeline, ``recompute_packing``'s times) are the profile's times",
    )
    recompute: list[list[str]] | None = Field(
        default=None,
        description="``activation_checkpointing = 'auto'``: each group's mode, per micro-batch of the plan",
    )
    recompute_packing: RecomputePacking | None = Field(default=None, description="the packings the planner compared")


class TrainRecord(PlanRecord):
    """A trained step (``source`` ``"train"``): every record's keys and what training measured (null where the step
    was skipped)."""

    batch_index: int = Field(description="batch inside the epoch")
    doc_ids: list[int] = Field(description="corpus ids of the batch, in batch order (the ledger)")
    worker_ids: list[int] = Field(description="stable id of each rank: rank i ran on worker ``worker_ids[i]``")
    recoveries: list[Recovery] = Field(description="membership changes made for this step")
    measured_ms: float | None = Field(description="dispatch to the last outcome: what ``predicted_ms`` predicts")
    compute_ms: float | None = Field(description="slowest rank, start to end of its micro-batches")
    sync_ms: float | None = Field(description="slowest rank's gradient all-reduce")
    optim_ms: float | None = Field(description="slowest rank's optimizer step")
    dispatch_ms: float | None = Field(description="time sending the step to the workers")
    plan_wait_ms: float = Field(description="time the driver waited for the plan (0: the solve hid behind a step)")
    overhead_ms: float | None = Field(description="driver bookkeeping after the outcomes")
    loss: float | None = Field(allow_inf_nan=True, description="mean over ``targets`` (multi-task: weighted by task)")
    tokens_per_s: float | None = Field(description="``tokens`` over ``measured_ms``")
    lr: float | None = Field(description="the learning rate the step used")
    grad_norm: float | None = Field(allow_inf_nan=True, description="the gradient's norm before clipping")
    router_aux_loss: float | None = Field(
        default=None, allow_inf_nan=True,
        description="an MoE model that trains its router loss: the step's load-balancing loss, unweighted (the "
        "objective is ``loss + router_aux_loss_coef * router_aux_loss``)",
    )  # fmt: skip
    router_ms: float | None = Field(default=None, description="the forward-only pass that counted the step's routing")
    ranks: list[RankEntry | None] | None = Field(description="per rank; null for a rank lost after the update")
    targets: int | None = Field(
        default=None,
        description="tokens that carried loss, the loss's denominator: ``tokens`` for plain text, fewer where loss "
        "masks leave prompts out",
    )
    nodes: list[str | None] = Field(default=None, description="each rank's node by address (else Ray node id)")
    boundary_ms: float | None = Field(default=None, description="membership work between the previous step and this")
    model_state: dict[str, Any] | None = Field(
        default=None, description="SP steps: the sharding in force and the plan's model-state bytes per worker"
    )
    sources: dict[str, Any] | None = Field(
        default=None, description="``[[data.sources]]``: each source's docs, tokens and epoch in this batch"
    )
    tasks: dict[str, Any] | None = Field(
        default=None, description="``[[tasks]]``: each task's docs, tokens, targets, loss and epoch"
    )
    task_losses: dict[str, Annotated[float, Field(allow_inf_nan=True)]] | None = Field(
        default=None, description="the tasks' losses by name (what the trackers log as ``loss/<task>``)"
    )
    multitask: dict[str, Any] | None = Field(default=None, description="how the plan placed the tasks")


def record_json_schema() -> dict:
    """The JSON Schema of a trained step's record (a plan record is the same without the training keys)."""
    return TrainRecord.model_json_schema(by_alias=True)
