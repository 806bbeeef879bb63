"""Run a pipeline schedule on paper: op start and end times, bubbles, activation memory per stage.

Each stage runs its ops in the schedule's order, one at a time. An op starts when its stage is free and its
inputs are there:

* ``F u`` on stage r > 0 needs ``F u`` on stage r-1 (plus one point-to-point send, ``p2p_ms``);
* ``B u`` on stage r < P-1 needs ``B u`` on stage r+1 (plus ``p2p_ms``); on the last stage it needs ``F u``;
* on one stage, the schedule's order already puts a sequence's segments in order (forward) and in reverse
  (backward), see ``flexorch.solver.pipeline.schedule``.

A stage whose next op waits on an op that can never run is a deadlock: :func:`simulate` raises
:class:`ScheduleError` naming the stuck ops instead of hanging. Memory: a unit's activations are held on a stage
from the end of its forward to the end of its backward; the peak is the largest sum held at once.

The bubble share is the idle part of the stages' time: ``1 - sum(busy) / (P * makespan)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexorch.solver.pipeline.schedule import Op, ScheduleError

__all__ = ["OpTiming", "PipelineRun", "simulate"]


@dataclass(frozen=True)
class OpTiming:
    stage: int
    op: Op
    start_ms: float
    end_ms: float


@dataclass(frozen=True)
class PipelineRun:
    makespan_ms: float
    busy_ms: tuple[float, ...]
    """Per stage: time spent running ops."""
    peak_bytes: tuple[float, ...]
    """Per stage: most activation bytes held at once."""
    timings: tuple[OpTiming, ...]

    @property
    def bubble_share(self) -> float:
        total = len(self.busy_ms) * self.makespan_ms
        return 0.0 if total <= 0 else 1.0 - sum(self.busy_ms) / total


def simulate(
    schedule: list[list[Op]],
    fwd_ms: list[list[float]],
    bwd_ms: list[list[float]],
    act_bytes: list[list[float]],
    p2p_ms: float | list[float] = 0.0,
    start_ms: float = 0.0,
) -> PipelineRun:
    """Times of every op of ``schedule``; ``fwd_ms[r][u]``, ``bwd_ms[r][u]``, ``act_bytes[r][u]`` per stage and unit;
    ``p2p_ms``: one send between stages, for every unit or per unit."""
    stages = len(schedule)
    n_units = len(fwd_ms[0]) if fwd_ms else 0
    send = list(p2p_ms) if isinstance(p2p_ms, list | tuple) else [float(p2p_ms)] * n_units
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, unit) -> end time
    free = [start_ms] * stages
    nxt = [0] * stages
    busy = [0.0] * stages
    held = [0.0] * stages
    peak = [0.0] * stages
    events: list[list[tuple[float, float]]] = [[] for _ in range(stages)]  # (time, +/- bytes)
    timings = []
    remaining = sum(len(ops) for ops in schedule)
    while remaining:
        progressed = False
        for r in range(stages):
            while nxt[r] < len(schedule[r]):
                op = schedule[r][nxt[r]]
                if op.kind == "F":
                    dep = ("F", r - 1, op.unit) if r > 0 else None
                    own = None
                else:
                    dep = ("B", r + 1, op.unit) if r < stages - 1 else None
                    own = ("F", r, op.unit)
                if (dep is not None and dep not in done) or (own is not None and own not in done):
                    break
                ready = free[r]
                if dep is not None:
                    ready = max(ready, done[dep] + send[op.unit])
                if own is not None:
                    ready = max(ready, done[own])
                dur = fwd_ms[r][op.unit] if op.kind == "F" else bwd_ms[r][op.unit]
                end = ready + dur
                done[(op.kind, r, op.unit)] = end
                free[r] = end
                busy[r] += dur
                events[r].append((end, act_bytes[r][op.unit] if op.kind == "F" else -act_bytes[r][op.unit]))
                timings.append(OpTiming(r, op, ready, end))
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = ", ".join(f"stage {r} at {schedule[r][nxt[r]]}" for r in range(stages) if nxt[r] < len(schedule[r]))
            raise ScheduleError(f"the schedule deadlocks: {stuck} wait on ops that can never run")
    for r in range(stages):
        # releases before allocations at the same instant: a backward frees what the next forward may take
        for _, delta in sorted(events[r], key=lambda e: (e[0], e[1])):
            held[r] += delta
            peak[r] = max(peak[r], held[r])
    makespan = max(free) - start_ms if timings else 0.0
    return PipelineRun(makespan, tuple(busy), tuple(peak), tuple(timings))
