"""The keys of a step record (``flexorch.step/4``) and their types: the tables `flexorch.records.schema` checks a
record against (what each key means: that module's docstring)."""

from __future__ import annotations

__all__ = ["COMMON_KEYS", "DRAIN_KEYS", "GROUP_KEYS", "LEFT_KEYS", "PIPELINE_KEYS", "TRAIN_KEYS"]

INT = (int,)
NUM = (int, float)

# key: (allowed types, may be null)
COMMON_KEYS = {
    "schema": ((str,), False),
    "source": ((str,), False),
    "step": (INT, False),
    "time": (NUM, False),
    "epoch": (INT, False),
    "world_size": (INT, False),
    "seq_lengths": ((list,), False),
    "tokens": (INT, False),
    "status": ((str,), False),
    "skipped": ((bool,), False),
    "reason": ((str,), True),
    "mode": ((str,), False),
    "shape": ((str,), True),
    "plan": ((dict,), True),
    "timeline": ((list,), True),
    "solve_s": (NUM, False),
    "predicted_ms": (NUM, True),
    "bound_ms": (NUM, False),
    "baselines_ms": ((dict,), False),
    "pipeline": ((dict,), True),
}
"""The keys of every record."""
TRAIN_KEYS = {
    "batch_index": (INT, False),
    "doc_ids": ((list,), False),
    "worker_ids": ((list,), False),
    "recoveries": ((list,), False),
    "measured_ms": (NUM, True),
    "compute_ms": (NUM, True),
    "sync_ms": (NUM, True),
    "optim_ms": (NUM, True),
    "dispatch_ms": (NUM, True),
    "plan_wait_ms": (NUM, False),
    "overhead_ms": (NUM, True),
    "loss": (NUM, True),
    "tokens_per_s": (NUM, True),
    "lr": (NUM, True),
    "grad_norm": (NUM, True),
    "ranks": ((list,), True),
}
"""The keys of a trained step's record (``source`` ``"train"``), besides the common ones."""
GROUP_KEYS = ("degree", "kind", "ranks", "seq_ids", "seq_lengths")
"""The keys of each group of ``plan.micro_batches``."""
PIPELINE_KEYS = "stages degree layers stage_ranks granularity bubble_share peak_bytes units checkpointed ops".split()
"""The keys of ``pipeline`` (a pipelined step)."""
DRAIN_KEYS = ("node", "reason", "deadline", "seen_at", "fallback")
"""A drain's fields: on a ``drain`` recovery, or under ``drain`` on a loss on a draining node."""
LEFT_KEYS = ("handoff_ms", "handoff_bytes", "reform_ms", "recovery_ms")
"""The figures of a drain whose workers left."""
