"""The run directory's step records: one JSON object per line in ``RUN_DIR/steps.jsonl``.

The schema, ``flexorch.step/4``, is documented in :mod:`flexorch.records.step_keys` and checked by
:mod:`flexorch.records.schema`; `flexorch plan` and `flexorch train` build their records with :func:`plan_fields`,
:func:`plan_record` and :func:`step_record` here, so both write the same keys.

On ``--resume`` the records of steps after the checkpoint are dropped, so the file always describes the steps
the current model has trained on, each exactly once.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from flexorch.records.schema import SCHEMA, RecordError, validate_record
from flexorch.solver.simulator import group_timings

__all__ = [
    "SCHEMA",
    "StepRecords",
    "read_records",
    "plan_fields",
    "pipeline_fields",
    "plan_record",
    "step_record",
    "skip_record",
    "measured_bubble_share",
]


class StepRecords:
    """Appends step records to ``RUN_DIR/steps.jsonl``."""

    def __init__(self, run_dir: Path | str, keep_before_step: int | None = None):
        self.path = Path(run_dir) / "steps.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep_before_step is None:
            self.path.write_text("")
        else:  # resume: keep what the checkpoint had trained
            self.truncate(keep_before_step)

    def truncate(self, before_step: int) -> None:
        """Keep the records of steps before ``before_step`` (a resume or a roll-back trains the rest again)."""
        kept = [r for r in read_records(self.path) if r["step"] < before_step] if self.path.exists() else []
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def append(self, record: dict) -> dict:
        record = {"schema": SCHEMA, "time": time.time(), **record}
        validate_record(record, f"step {record.get('step')}")  # a writer bug must not leave a record nobody can read
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        return record


def read_records(path: Path | str, validate: bool = False) -> list[dict]:
    """All records of a steps.jsonl file; a malformed line raises :class:`RecordError` (a ValueError) naming it.

    With ``validate`` every record is also checked against the schema."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise RecordError(f"{path}:{i}: not a JSON record ({e})") from None
        out.append(validate_record(rec, f"{path}:{i}") if validate else rec)
    return out


def pipeline_fields(staged) -> dict:
    """``shape``, ``plan``/``timeline`` (null) and ``pipeline`` of a pipelined step
    (``flexorch.solver.pipeline.staged.StagedPlan``): stages, their ranks, units, checkpointing and the simulated
    schedule."""
    return {"shape": staged.shape(), "plan": None, "timeline": None, "pipeline": staged.to_dict()}


def plan_fields(planned, profile, level: float = 1.0) -> dict:
    """``shape``, ``plan``, ``timeline`` (the cost model's schedule: when each group starts and how long it runs) and
    ``pipeline`` (null) of a planned step (``flexorch.solver.planned_step.PlannedStep``), or :func:`pipeline_fields`
    when it is pipelined; then how it was planned: ``status``, ``predicted_ms``, ``bound_ms``.

    ``level``: the run's step level when the step was dispatched (``solver.step_level``); every price of the plan
    (``predicted_ms``, ``bound_ms``, the timeline) is ``profile``'s times ``level``, and ``level`` is recorded."""
    solve = {
        "status": planned.status,
        "skipped": False,
        "reason": None,
        "predicted_ms": planned.predicted_ms * level,
        "profile_revision": planned.profile_revision,
        "level": level,
        "bound_ms": planned.bound_ms * level,
        "plan_budget_s": planned.budget_s or None,
        "gap": planned.gap,
        "fallback": fallback_field(planned),
        "solver_crashes": planned.solver_crashes,
    }
    if planned.pipelined:
        return {**pipeline_fields(planned.plan), **solve}
    plan = planned.plan
    return {
        "shape": plan.shape(),
        "plan": plan.to_dict(),
        "timeline": [
            {
                "micro_batch": g.micro_batch,
                "group": g.group,
                "start_ms": g.start_ms * level,
                "time_ms": g.time_ms * level,
            }
            for g in group_timings(plan, profile)
        ],
        "pipeline": None,
        **solve,
    }


def fallback_field(planned) -> dict | None:
    """``{"reason", "message"}`` when the step did not get the planner's own plan (``PlannedStep.fallback_reason``:
    'timeout', 'crash', 'error'), else None."""
    if planned.fallback_reason is None:
        return None
    return {"reason": planned.fallback_reason, "message": planned.fallback_message}


def plan_record(base: dict, planned, profile) -> dict:
    """A `flexorch plan` record: ``base`` (step, epoch, world_size, seq_lengths, mode) plus the planned step."""
    return {
        "schema": SCHEMA,
        "source": "plan",
        "time": time.time(),
        **base,
        "tokens": sum(int(s) - 1 for s in base["seq_lengths"]),
        **plan_fields(planned, profile),
        "solve_s": planned.solve_s,
        "baselines_ms": planned.baselines_ms,
    }


_TRAIN_ONLY_NULL = (
    "measured_ms compute_ms sync_ms optim_ms dispatch_ms overhead_ms loss tokens_per_s lr grad_norm ranks"
).split()


def skip_record(base: dict, status: str, reason: str) -> dict:
    """The record of a training step whose batch no plan fits (nothing ran)."""
    return {
        **base,
        "source": "train",
        "tokens": sum(s - 1 for s in base["seq_lengths"]),
        "status": status,
        "skipped": True,
        "reason": reason,
        "shape": None,
        "plan": None,
        "timeline": None,
        "predicted_ms": None,
        "bound_ms": 0.0,
        "pipeline": None,
        "fallback": {"reason": status, "message": reason},
        **dict.fromkeys(_TRAIN_ONLY_NULL),
    }


def _rank_entry(o, n_mb: int, pipelined: bool) -> dict | None:
    if o is None:  # a rank lost after the update stood (its outcome never came back)
        return None
    if pipelined:
        return {
            "micro_batch_ms": [],
            "micro_batch_start_ms": [],
            "compute_end_ms": o.compute_end_ms,
            "local_tokens": o.local_tokens,
            "peak_local_tokens": o.peak_local_tokens,
            "peak_activation_bytes": o.peak_activation_bytes,
            "ops": list(o.ops),
            "param_bytes": o.param_bytes,
        }
    ms: list[float | None] = [None] * n_mb
    start: list[float | None] = [None] * n_mb
    for mb, t, t0 in zip(o.micro_batches, o.micro_batch_ms, o.micro_batch_start_ms, strict=True):
        ms[mb], start[mb] = t, t0
    entry = {
        "micro_batch_ms": ms,
        "micro_batch_start_ms": start,
        "compute_end_ms": o.compute_end_ms,
        "local_tokens": o.local_tokens,
        "peak_local_tokens": o.peak_local_tokens,
        "peak_activation_bytes": o.peak_activation_bytes,
        "state_bytes": o.param_bytes,
        "compile_s": o.compile_s,
    }
    waits = o.wait_ms
    if waits and len(waits) == len(o.micro_batches):  # reported where the collectives block the host
        entry["wait_ms"] = [None] * n_mb
        for mb, w in zip(o.micro_batches, waits, strict=True):
            entry["wait_ms"][mb] = round(w, 3)
    return entry


def step_record(
    base: dict, planned, profile, outcomes: list, measured_ms: float, dispatch_ms: float, level: float = 1.0
) -> dict:
    """The record of a trained step: ``base`` (batch, world, recoveries) plus the plan and every rank's outcome.

    ``outcomes[r]`` is rank r's :class:`flexorch.workers.step_exec.StepOutcome`, or None for a rank lost after the
    update had been applied (the step stands; its ``ranks`` entry is null). ``level``: the run's step level the plan
    is priced at (:func:`plan_fields`; the static layouts' ``baselines_ms`` too)."""
    done = [o for o in outcomes if o is not None]
    tokens = sum(int(s) - 1 for s in base["seq_lengths"])  # every position the step computed a prediction at
    pipelined = planned.pipelined
    n_mb = 0 if pipelined else len(planned.plan.micro_batches)
    return {
        **base,
        "source": "train",
        "tokens": tokens,
        "targets": done[0].num_predicted,
        **plan_fields(planned, profile, level),
        "baselines_ms": _leveled(base.get("baselines_ms"), level),
        **({"recompute_packing": _leveled(base["recompute_packing"], level)} if "recompute_packing" in base else {}),
        "measured_ms": measured_ms,
        "compute_ms": max(o.compute_end_ms for o in done),
        "sync_ms": max(o.sync_ms for o in done),
        "optim_ms": max(o.optim_ms for o in done),
        "dispatch_ms": dispatch_ms,
        "loss": done[0].loss,
        "tokens_per_s": tokens / max(measured_ms / 1e3, 1e-9),
        "lr": done[0].lr,
        "grad_norm": done[0].grad_norm,
        "ranks": [_rank_entry(o, n_mb, pipelined) for o in outcomes],
        **({"task_losses": dict(done[0].task_losses)} if done[0].task_losses else {}),
        **_router_fields(done),
    }


def _router_fields(done: list) -> dict:
    """An MoE model's router loss (the same on every rank) and its counting pass (the slowest rank's)."""
    if done[0].router_aux_loss is None:
        return {}
    return {"router_aux_loss": done[0].router_aux_loss, "router_ms": max(o.router_ms for o in done)}


def _leveled(prices: dict | None, level: float) -> dict | None:
    """``prices`` (a name -> ms table: ``baselines_ms``, ``recompute_packing``'s ``*_ms``) at the step's level."""
    if prices is None:
        return None
    return {k: v * level if isinstance(v, int | float) and not isinstance(v, bool) else v for k, v in prices.items()}


def measured_bubble_share(record: dict) -> float | None:
    """The measured counterpart of ``pipeline.bubble_share`` for a trained pipelined step: ``1 - sum(busy) /
    (ranks * span)`` over the ranks that ran stage ops, busy being each rank's time in its ops (input received to
    done) and span the latest op end, both from each rank's own step start. None for SP steps, plan records and
    steps no rank reported ops for."""
    if record.get("pipeline") is None or record.get("source") != "train":
        return None
    ops = [entry["ops"] for entry in record.get("ranks") or [] if entry and entry.get("ops")]
    if not ops:
        return None
    busy = sum(o["end_ms"] - o["start_ms"] for rank_ops in ops for o in rank_ops)
    span = max(o["end_ms"] for rank_ops in ops for o in rank_ops)
    return max(0.0, 1.0 - busy / (len(ops) * span)) if span > 0 else 0.0
