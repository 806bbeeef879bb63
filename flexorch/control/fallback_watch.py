"""The run's warning when its steps keep going without the planner's plan (a solve timed out, crashed, failed or
found the batch infeasible): said once, loudly, with what to do for each reason seen.

Each step's record says why it fell back (``fallback.reason``, ``flexorch.records.schema.FALLBACK_REASONS``); the
driver hands every record to :meth:`FallbackWatch.watch` (a step callback, ``control.step_callbacks``).
"""

from __future__ import annotations

import collections

from flexorch.control.step_callbacks import StepCallback

__all__ = ["FALLBACK_MIN_STEPS", "FALLBACK_WINDOW", "FallbackWatch"]

FALLBACK_WINDOW = 20
"""The recent steps the fallback warning looks at: more than a tenth of them without the planner's plan (at least
:data:`FALLBACK_MIN_STEPS` seen) and the run says so, once."""
FALLBACK_MIN_STEPS = 10


class FallbackWatch(StepCallback):
    """The fallback reasons of the last :data:`FALLBACK_WINDOW` steps, and whether the run has warned yet."""

    def __init__(self, publish):
        self._publish = publish
        self._fallbacks: collections.deque = collections.deque(maxlen=FALLBACK_WINDOW)
        self._fallback_warned = False

    def on_step(self, record: dict, plan) -> None:
        """The step callback (``control.step_callbacks``): :meth:`watch` the record."""
        self.watch(record)

    def watch(self, record: dict) -> None:
        """Say once, loudly, when more than a tenth of the recent steps did not get the planner's plan."""
        self._fallbacks.append((record.get("fallback") or {}).get("reason"))
        seen = [r for r in self._fallbacks if r is not None]
        if self._fallback_warned or len(self._fallbacks) < FALLBACK_MIN_STEPS or len(seen) * 10 <= len(self._fallbacks):
            return
        self._fallback_warned = True
        counts = collections.Counter(seen)
        why = ", ".join(f"{k} {v}" for k, v in counts.most_common())
        todo = {
            "timeout": "give the planner more time (plan.time_limit_s, plan.timeout_s) or the driver's node more "
            "idle CPU (a busy head node starves it)",
            "crash": "try the other MILP backend (plan.solver = 'highs' or 'cbc') and report the crash",
            "error": "this is a bug: report it with the step records (steps.jsonl)",
            "infeasible": "lower data.max_context or raise plan.tokens_per_worker so every batch fits",
        }
        advice = "; ".join(todo[k] for k in counts)
        self._publish(
            {
                "event": "planner",
                "message": f"WARNING: {len(seen)} of the last {len(self._fallbacks)} steps ran without the planner's "
                f"plan ({why}): the run is slower than planned. What to do: {advice}. Each step's record says why "
                "(steps.jsonl 'fallback'; metric flexorch_plan_fallbacks_total by reason).",
            }
        )
