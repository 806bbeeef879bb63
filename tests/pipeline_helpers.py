"""Pipelined step records for the plan viewer tests: the recorded `flexorch plan --pipeline-stages` run, and a
trained pipelined step built from one of its records (no training run needed: what the viewer reads is the record).
"""

from __future__ import annotations

import copy
import json

from tests.paths import DATA

RECORDED_PIPELINE = DATA / "recorded_pipeline_plan"

LATE_MS = 5.0
"""The first rank of every stage starts each op this much later than the others ..."""
SLOW = 0.2
"""... and rank j of a stage takes (1.1 + SLOW * j) x the predicted time of each op."""


TIGHT_PROFILE = {
    "name": "three-layers",
    "a1_ms": 5.128e-06,
    "a2_ms": 0.18396,
    "b1_ms": 629.36,
    "act_bytes_per_token": 30000.0,
    "memory_budget_bytes": 1e8,
    "num_layers": 3,
    "hidden": 8192,
    "num_heads": 64,
    "num_kv_heads": 1,
    "a2a_gbps": {"2": 100.0},
}
"""A profile (JSON) whose memory binds pipelines: 3 layers on 2 stages put 2 on stage 0, and checkpointing saves
nothing (a layer's kept input is as big as its activations), so stage 0 holds 5000 tokens at once (0.09 GiB;
one KV head of 128 dims keeps a segment's K/V prefix small),
while an SP group of 2 devices holds 6666."""


def pipeline_plan_records() -> list[dict]:
    return [json.loads(line) for line in (RECORDED_PIPELINE / "steps.jsonl").read_text().splitlines()]


def measured_op(pred_start: float, pred_ms: float, j: int) -> tuple[float, float]:
    """(start, length) that rank ``j`` of a stage reports for an op predicted at ``pred_start`` for ``pred_ms``."""
    return pred_start * 1.25 + (LATE_MS if j == 0 else 0.0), pred_ms * (1.1 + SLOW * j)


def train_record_from_plan(plan_rec: dict, lost: tuple[int, ...] = ()) -> dict:
    """A ``source: "train"`` copy of a pipelined plan record, as `flexorch train` would write it: the train keys,
    and per rank the measured ops of its stage (:func:`measured_op`) in the order they ran; ranks in ``lost`` are
    null (lost after the update was applied), ranks in no stage report no ops."""
    rec = copy.deepcopy(plan_rec)
    pipe, n = rec["pipeline"], rec["world_size"]
    stage_of = {r: (s, j) for s, rs in enumerate(pipe["stage_ranks"]) for j, r in enumerate(rs)}
    ranks, ends = [], [0.0]
    for r in range(n):
        ops = []
        if r in stage_of:
            s, j = stage_of[r]
            for o in pipe["ops"]:
                if o["stage"] == s:
                    start, ms = measured_op(o["start_ms"], o["end_ms"] - o["start_ms"], j)
                    ops.append({"kind": o["kind"], "unit": o["unit"], "start_ms": start, "end_ms": start + ms})
            ops.sort(key=lambda o: o["start_ms"])
        ends += [o["end_ms"] for o in ops]
        ranks.append(
            None
            if r in lost
            else {
                "micro_batch_ms": [],
                "micro_batch_start_ms": [],
                "compute_end_ms": max((o["end_ms"] for o in ops), default=0.0),
                "local_tokens": sum(u["tokens"] for u in pipe["units"]) // pipe["degree"] if ops else 0,
                "peak_local_tokens": max(u["tokens"] for u in pipe["units"]) // pipe["degree"] if ops else 0,
                "peak_activation_bytes": 1_000_000 if ops else 0,
                "ops": ops,
            }
        )
    compute = max(ends)
    rec.update(
        source="train",
        batch_index=rec["step"],
        doc_ids=list(range(len(rec["seq_lengths"]))),
        worker_ids=list(range(n)),
        recoveries=[],
        measured_ms=compute + 40.0,
        compute_ms=compute,
        sync_ms=25.0,
        optim_ms=10.0,
        dispatch_ms=2.0,
        plan_wait_ms=0.0,
        overhead_ms=3.0,
        loss=4.2,
        tokens_per_s=rec["tokens"] / ((compute + 40.0) / 1e3),
        lr=3e-4,
        grad_norm=1.5,
        ranks=ranks,
    )
    return rec
