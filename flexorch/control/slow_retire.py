"""Workers that stay slow, retired as failed (``[elastic] retire_below_speed``, ``retire_after_steps``): who, and what
the record and the console say.

The planner already plans around a slow worker (its speed prices its groups, ``flexorch.solver.worker_speeds``);
some are too slow to be worth a share at all (a GPU stuck at its lowest clock, a host swapping), and a run may say
so: a worker whose speed stayed below ``retire_below_speed`` for ``retire_after_steps`` observed steps is retired at
the next step boundary. It leaves as a drained node's workers do (``Elastic.retire_slow``: it hands off what only
it holds, the world re-forms without it, nothing is re-run), never taking the world below ``min_workers``
(``ElasticPolicy.on_slow``; then it stays and the console says why, once). NVIDIA's resiliency extension scores
each rank's performance from 0 to 1 against the best rank's (``nvidia_resiliency_ext.straggler``, "relative performance
score"; nvidia.github.io/nvidia-resiliency-ext/straggler_det/usage_guide.html) and Megatron Bridge can stop the whole
run when one falls under its threshold (``NVRxStragglerDetectionConfig.stop_if_detected``); here the worker alone
goes, as an elastic membership change like any other, and the run goes on without it.

:class:`SlowWorkers` is the seam to the speed estimate: the driver's ``control.speed_watch.SpeedWatch``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["SlowWorkers", "slow_members", "retire_reason", "retire_record", "retire_line", "kept_line"]


class SlowWorkers(Protocol):
    """What the retire asks of the speed estimate."""

    def slow_workers(self, threshold: float, for_steps: int) -> list[int]:
        """Workers whose speed stayed below ``threshold`` for their last ``for_steps`` observed steps."""
        ...

    def estimate(self, worker: int) -> float:
        """A worker's speed relative to the others (1.0: the median worker's)."""
        ...


def slow_members(speeds: SlowWorkers, members: Sequence[int], rank_nodes: Sequence, below: float, steps: int):
    """The members ``speeds`` finds slow, slowest first: ``{"worker", "node", "speed"}`` each (``rank_nodes``: each
    member's node, in the order of ``members``; speed to 3 decimals)."""
    node_of = dict(zip(members, rank_nodes, strict=True))
    slow = [w for w in dict.fromkeys(speeds.slow_workers(below, steps)) if w in node_of]
    found = [{"worker": w, "node": node_of[w], "speed": round(float(speeds.estimate(w)), 3)} for w in slow]
    return sorted(found, key=lambda s: (s["speed"], s["worker"]))


def _who(slow: list[dict]) -> str:
    return ", ".join(f"worker {s['worker']} on node {s['node'] or '?'} at {s['speed']:.2f}x" for s in slow)


def retire_reason(slow: list[dict], below: float, steps: int) -> str:
    """``slow: worker 3 on node 10.0.0.7 at 0.21x the others for 5 steps, below [elastic] retire_below_speed =
    0.3``: the recovery record's ``reason``."""
    return f"slow: {_who(slow)} the others for {steps} steps, below [elastic] retire_below_speed = {below:g}"


def retire_record(slow: list[dict], below: float, steps: int, after_step: int, before: list[int], left: dict) -> dict:
    """The step record's ``recoveries`` entry of a retire: ``what`` ``"retire"``, the decision, the retired as
    ``lost`` (retired as failed; nothing re-run), why (:func:`retire_reason`) and each one's ``slow`` entry
    (worker, node, speed), the step it followed, the worlds, and ``left``: the planned leave's figures
    (``Elastic._planned_leave``: ``handoff_ms``, ``reform_ms``, ``recovery_ms``, ``world_after``, ...)."""
    lost = sorted(s["worker"] for s in slow)
    rec = {"what": "retire", "decisions": ["Retire"], "lost": lost, "reason": retire_reason(slow, below, steps)}
    rec.update(slow=slow, below=below, for_steps=steps, after_step=after_step, world_before=list(before))
    rec.update(left)
    return rec


def retire_line(rec: dict) -> str:
    """The one console line of a retire."""
    when = f"after step {rec['after_step']}" if rec["after_step"] >= 0 else "before the first step"
    layout = f"; {rec['layout']}" if rec.get("layout") else ""
    return (
        f"membership: {rec['reason']}: retired as failed {when} in {rec['recovery_ms'] / 1e3:.1f} s, nothing re-run "
        f"(handoff {rec.get('handoff_ms', 0.0) / 1e3:.1f} s, re-form {rec['reform_ms'] / 1e3:.1f} s), world "
        f"{len(rec['world_before'])} -> {len(rec['world_after'])}{layout}"
    )


def kept_line(slow: list[dict], below: float, steps: int, why: str) -> str:
    """The console's warning, once per worker, for slow workers the world cannot lose."""
    one = len(slow) == 1
    return (
        f"membership: {_who(slow)} the others for {steps} steps, below [elastic] retire_below_speed = {below:g}, but "
        f"{'it stays' if one else 'they stay'}: {why}; the planner keeps planning around {'it' if one else 'them'}"
    )
