"""The multi-task step plan: parts of MetaOps placed on device blocks in time; a frozen value that validates itself.

A part is l layers of one MetaOp run on an aligned power-of-two block of devices (``ranks[0] % size == 0``, like
flexorch's SP groups, ``flexorch/solver/plan.py`` Group) from ``start_ms`` for ``time_ms = l * T_m(size)``. A wave is
the parts that start at the same instant (Spindle, arXiv 2409.03365, §4.3 "wavefront scheduling"). A part holds its
block until it ends; parts that overlap in time have disjoint blocks; a task's parts run one after another in level
order; every layer of every MetaOp runs exactly once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flexorch.solver.errors import InvalidPlanError
from flexorch.solver.multitask.metaop import MetaOp

__all__ = ["Part", "Wave", "MultiTaskPlan", "waves_of"]

_TOL = 1e-9


@dataclass(frozen=True)
class Part:
    task: int
    metaop: int
    """The MetaOp's level in its task."""
    layers: int
    devices: tuple[int, ...]
    """Ranks: an aligned block of consecutive ranks of power-of-two size."""
    start_ms: float
    time_ms: float

    @property
    def end_ms(self) -> float:
        return self.start_ms + self.time_ms


@dataclass(frozen=True)
class Wave:
    start_ms: float
    parts: tuple[Part, ...]

    @property
    def time_ms(self) -> float:
        """The longest part of the wave."""
        return max(p.time_ms for p in self.parts)


def waves_of(parts) -> tuple[Wave, ...]:
    """Parts grouped by start time, in time order."""
    by_start: dict[float, list[Part]] = {}
    for p in sorted(parts, key=lambda p: (p.start_ms, p.devices[0])):
        by_start.setdefault(p.start_ms, []).append(p)
    return tuple(Wave(s, tuple(ps)) for s, ps in by_start.items())


@dataclass(frozen=True, kw_only=True)
class MultiTaskPlan:
    num_devices: int
    metaops: tuple[MetaOp, ...]
    waves: tuple[Wave, ...]
    makespan_ms: float
    """The step's time: the last part's end."""
    bound_ms: float
    """Proven lower bound on the makespan of any schedule of these MetaOps (C*, ``allocation``)."""
    solve_s: float = 0.0
    baselines_ms: dict[str, float] = field(default_factory=dict, compare=False, hash=False)
    """Same MetaOps, same cost model: ``in_turn`` and ``fixed_split`` (inf when impossible)."""
    method: str = "spindle"
    """Which schedule this is: ``spindle``, or the baseline it fell back to."""
    note: str = ""

    @property
    def gap(self) -> float:
        return self.makespan_ms / self.bound_ms - 1.0

    @property
    def parts(self) -> tuple[Part, ...]:
        return tuple(p for w in self.waves for p in w.parts)

    def __post_init__(self) -> None:
        n = self.num_devices
        ops = {(m.task, m.level): m for m in self.metaops}
        parts = self.parts
        if not parts:
            raise InvalidPlanError("a multi-task plan needs at least one part")
        covered = dict.fromkeys(ops, 0)
        for p in parts:
            m = ops.get((p.task, p.metaop))
            if m is None:
                raise InvalidPlanError(f"part of task {p.task} runs MetaOp level {p.metaop}, which does not exist")
            d, r = len(p.devices), p.devices
            if d & (d - 1) or r[0] % d or r[-1] >= n or any(r[i] != r[0] + i for i in range(d)):
                raise InvalidPlanError(f"{m.name}: devices {r[0]}..{r[-1]} ({d}) are not an aligned block within {n}")
            if p.layers < 1 or p.start_ms < 0 or not math.isclose(p.time_ms, m.time_ms(d, p.layers), rel_tol=_TOL):
                raise InvalidPlanError(
                    f"{m.name}: part of {p.layers} layers on {d} devices from {p.start_ms:.3f} ms takes "
                    f"{p.time_ms:.3f} ms; the MetaOp says {m.time_ms(d, p.layers):.3f} ms"
                )
            covered[p.task, p.metaop] += p.layers
        wrong = {ops[k].name: (v, ops[k].layers) for k, v in covered.items() if v != ops[k].layers}
        if wrong:
            raise InvalidPlanError(f"layers run vs layers of the MetaOp: {wrong} (each layer must run exactly once)")
        for w in self.waves:
            if any(p.start_ms != w.start_ms for p in w.parts):
                raise InvalidPlanError(f"a wave at {w.start_ms:.3f} ms holds a part that starts at another time")
        self._check_order(parts)
        self._check_devices(parts)
        end = max(p.end_ms for p in parts)
        if not math.isclose(self.makespan_ms, end, rel_tol=_TOL):
            raise InvalidPlanError(f"makespan_ms={self.makespan_ms:.3f} but the last part ends at {end:.3f} ms")
        if self.bound_ms > self.makespan_ms * (1 + 1e-7):
            raise InvalidPlanError(f"bound {self.bound_ms:.3f} ms is above the makespan {self.makespan_ms:.3f} ms")

    @staticmethod
    def _check_order(parts) -> None:
        by_task: dict[int, list[Part]] = {}
        for p in parts:
            by_task.setdefault(p.task, []).append(p)
        for t, ps in by_task.items():
            ps.sort(key=lambda p: p.start_ms)
            for a, b in zip(ps, ps[1:], strict=False):
                if b.start_ms < a.end_ms - _TOL * max(1.0, a.end_ms):
                    raise InvalidPlanError(
                        f"task {t}: a part starts at {b.start_ms:.3f} ms before the previous one ends "
                        f"({a.end_ms:.3f} ms); a task's parts run one after another"
                    )
                if b.metaop < a.metaop:
                    raise InvalidPlanError(f"task {t}: MetaOp level {b.metaop} runs after level {a.metaop}")

    @staticmethod
    def _check_devices(parts) -> None:
        ps = sorted(parts, key=lambda p: p.start_ms)
        for i, a in enumerate(ps):
            for b in ps[i + 1 :]:
                if b.start_ms >= a.end_ms - _TOL * max(1.0, a.end_ms):
                    break
                clash = set(a.devices).intersection(b.devices)
                if clash:
                    raise InvalidPlanError(
                        f"devices {sorted(clash)[:4]}... run task {a.task} ({a.start_ms:.3f}-{a.end_ms:.3f} ms) and "
                        f"task {b.task} ({b.start_ms:.3f}-{b.end_ms:.3f} ms) at once"
                    )
