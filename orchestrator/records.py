"""The run directory's step records: one JSON object per line in ``RUN_DIR/steps.jsonl``.

Schema ``flexorch.step/2`` (every key always present; times in ms unless the name ends in ``_s``):

* ``schema``, ``step`` (0-based), ``epoch`` (data epoch), ``batch_index`` (batch inside the epoch),
  ``doc_ids`` (corpus ids of the batch, the ledger), ``seq_lengths``, ``world_size``, ``mode``, ``status``
  (planner status, or ``skipped`` / ``infeasible``), ``skipped`` (bool) and ``reason`` (why, or null);
* ``shape`` and ``plan`` (``solver.plan.Plan.to_dict()``: micro-batches of groups with degree, kind, ranks,
  seq_ids, seq_lengths), ``solve_s``, ``predicted_ms``, ``bound_ms``, ``baselines_ms``;
* ``measured_ms`` (the step as the driver saw it: dispatch to the last outcome), ``compute_ms`` (slowest rank,
  start to end of its micro-batches; what ``predicted_ms`` predicts), ``sync_ms``, ``optim_ms``,
  ``dispatch_ms`` (driver work to send the step), ``plan_wait_ms`` (time the driver waited for the plan: zero
  when the solve hid behind the previous step), ``overhead_ms`` (driver bookkeeping after the outcomes);
* ``loss``, ``tokens`` (predicted tokens of the batch), ``tokens_per_s``, ``lr``, ``grad_norm``,
  ``ranks`` (per-rank ``micro_batch_ms``, ``compute_end_ms``, ``local_tokens``, ``peak_local_tokens``), ``time``
  (unix seconds);
* ``worker_ids`` (stable id of each rank of the world that ran the step: rank i is ``worker_ids[i]``) and
  ``recoveries``: membership changes made for this step, each with ``what``, ``world_before``, ``world_after``,
  ``recovery_ms`` and, after a failure, ``attempt``, ``decisions`` (the policy's, e.g. ``["Shrink"]``), ``lost``,
  ``reason`` and ``step_completed`` (survivors had finished the update, so the step was not re-run), or, when
  workers joined, ``joined``.

Version 2 added ``worker_ids`` and ``recoveries`` to version 1.

On ``--resume`` the records of steps after the checkpoint are dropped, so the file always describes the steps
the current model has trained on, each exactly once.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

__all__ = ["SCHEMA", "StepRecords", "read_records"]

SCHEMA = "flexorch.step/2"


class StepRecords:
    """Appends step records to ``RUN_DIR/steps.jsonl``."""

    def __init__(self, run_dir: Path | str, keep_before_step: int | None = None):
        self.path = Path(run_dir) / "steps.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep_before_step is None:
            self.path.write_text("")
        else:  # resume: keep what the checkpoint had trained
            kept = [r for r in read_records(self.path) if r["step"] < keep_before_step] if self.path.exists() else []
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def append(self, record: dict) -> dict:
        record = {"schema": SCHEMA, "time": time.time(), **record}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        return record


def read_records(path: Path | str) -> list[dict]:
    """All records of a steps.jsonl file; a malformed line raises ValueError naming it."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not a JSON record ({e})") from None
    return out


def step_record(base: dict, planned, outcomes: list, measured_ms: float, dispatch_ms: float) -> dict:
    """The record of a trained step: ``base`` (batch, world, recoveries) plus the plan and every rank's outcome."""
    tokens = outcomes[0].num_predicted
    return {
        **base,
        "status": planned.status,
        "skipped": False,
        "reason": None,
        "shape": planned.plan.shape(),
        "plan": planned.plan.to_dict(),
        "predicted_ms": planned.predicted_ms,
        "bound_ms": planned.bound_ms,
        "measured_ms": measured_ms,
        "compute_ms": max(o.compute_end_ms for o in outcomes),
        "sync_ms": max(o.sync_ms for o in outcomes),
        "optim_ms": max(o.optim_ms for o in outcomes),
        "dispatch_ms": dispatch_ms,
        "loss": outcomes[0].loss,
        "tokens": tokens,
        "tokens_per_s": tokens / max(measured_ms / 1e3, 1e-9),
        "lr": outcomes[0].lr,
        "grad_norm": outcomes[0].grad_norm,
        "ranks": [
            {
                "micro_batch_ms": o.micro_batch_ms,
                "compute_end_ms": o.compute_end_ms,
                "local_tokens": o.local_tokens,
                "peak_local_tokens": o.peak_local_tokens,
                "peak_activation_bytes": o.peak_activation_bytes,
            }
            for o in outcomes
        ],
    }
