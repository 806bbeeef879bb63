"""Baselines beside the planner, with the same cost model, the same packer and the same batch.

* `static-ulysses-<d>`: DeepSpeed-Ulysses style, every group has degree d (floor(N/d) groups), Ulysses attention;
* `static-ring-<d>`: Megatron context-parallel style, every group degree d with (zigzag) ring attention;
* `batchada`: FlexSP's 'BatchAda', the best homogeneous layout chosen per batch (over both kinds and all d).

Each static layout gets the same micro-batch candidates (Sequence Blaster splits) as the planner and keeps its
best, then the same local search, so the comparison measures the choice of groups, not different packers.
"""

from __future__ import annotations

import math
import time

import numpy as np

from flexorch.solver.cost_model import RING, ULYSSES, kind_allowed
from flexorch.solver.errors import PlanningError
from flexorch.solver.microbatching import iter_candidates
from flexorch.solver.paced import placed_micro_batches
from flexorch.solver.packing import (
    GroupType,
    drop_empty,
    improve_step,
    pack,
    time_table,
    type_overheads,
)
from flexorch.solver.plan import Plan
from flexorch.solver.profiles import Profile
from flexorch.solver.simulator import step_time_ms
from flexorch.solver.validation import check_batch, largest_degree

__all__ = [
    "BaselineRun",
    "static_plan",
    "static_layouts",
    "baseline_plans",
    "baseline_times_ms",
    "baselines_within",
]


def static_plan(
    lengths,
    num_devices: int,
    profile: Profile,
    degree: int,
    kind: str,
    extra_micro_batches: int = 4,
    deadline: float | None = None,
    topology=None,
) -> Plan | None:
    """Every group of `degree` with `kind` attention; None when that layout cannot run the batch. With a
    ``topology`` (``solver.topology``) the groups are placed on its nodes and priced where they lie; where its ranks
    have speeds, laid out at them (``solver.paced``: the layout's groups kept, work moved off the slow ones), so the
    BatchAda floor is the best static layout at those speeds.

    A split (and every larger M) whose lower bound (per micro-batch O + max(longest time, total time / groups))
    cannot beat the best split packed so far is not packed: the plan is the one packing every split gives (ties
    to the first split). Past `deadline` (``time.monotonic()``) the best split in hand is kept and its local search
    stops.
    """
    lengths = check_batch(lengths, num_devices, profile)
    if degree > num_devices or degree & (degree - 1) or not kind_allowed(kind, degree, profile):
        return None
    types = [_static_type(degree, kind, topology)]
    table = time_table(lengths, types, profile)
    overheads = type_overheads(types, profile)  # b1 + this degree's collective latency
    if not np.isfinite(table).all():
        return None  # some sequence needs a larger group
    ng = num_devices // degree
    cap = profile.group_token_cap(types[0].kind, degree)
    caps = np.full(ng, cap, dtype=np.int64)
    times, o = table[:, 0], float(overheads[0])
    floor = max(float(times.sum()) / ng, float(times.max()))  # sequence time of any split, beyond M * O
    best, best_total = None, np.inf
    for m, split in iter_candidates(lengths, times, ng * cap, extra_micro_batches):
        if m * o + floor >= best_total:
            break  # neither this M nor any larger one can beat the split in hand (ties go to the first)
        if best is not None and deadline is not None and time.monotonic() >= deadline:
            break
        if sum(o + max(float(times[c].max()), float(times[c].sum()) / ng) for c in split) >= best_total:
            continue
        drafts = [pack(items, [0] * ng, table, lengths, caps, overheads) for items in split]
        if any(d is None for d in drafts):
            continue
        total = sum(d.makespan() for d in drafts)
        if total < best_total:
            best, best_total = drafts, total
    if best is None:
        return None
    improve_step(best, [caps] * len(best), table, lengths, overheads, deadline=deadline)
    best = drop_empty(best)
    mbs = placed_micro_batches(best, types, table, lengths, np.array([cap]), overheads, topology, deadline=deadline)
    return Plan.for_profile(
        num_devices=num_devices,
        seq_lengths=lengths,
        micro_batches=mbs,
        profile=profile,
        meta={"planner": f"static-{kind}-{degree}"},
        topology=topology,
    )


def _static_type(degree: int, kind: str, topology) -> GroupType:
    """A static layout's group type, priced as spanning nodes where its degree exceeds the largest node."""
    spans = topology is not None and topology.num_nodes > 1 and degree > topology.max_node_size
    return GroupType(degree, ULYSSES if degree == 1 else kind, spans)


def static_layouts(num_devices: int) -> list[tuple[str, int]]:
    """(kind, degree) of every static baseline on N devices, in report order."""
    out, d = [], 1
    while d <= largest_degree(num_devices):
        out += [(k, d) for k in ((ULYSSES, RING) if d > 1 else (ULYSSES,))]
        d *= 2
    return out


def baseline_plans(
    lengths,
    num_devices: int,
    profile: Profile,
    extra_micro_batches: int = 4,
    deadline: float | None = None,
    topology=None,
) -> dict:
    """name -> Plan (or None when infeasible) for every static degree/kind, plus 'batchada' (the best of them).

    With `deadline` (``time.monotonic()``) the layouts are planned in the order of a lower bound on their step time
    (most promising first) and those not reached in time are None too, listed by :func:`skipped_baselines`:
    'batchada' is then the best of those planned (one layout at least is always planned).
    """
    plans, _ = _baselines(lengths, num_devices, profile, extra_micro_batches, deadline, topology=topology)
    return plans


def _baselines(lengths, num_devices, profile, extra_micro_batches, deadline, times=None, topology=None):
    ordered = deadline is not None
    run = BaselineRun(lengths, num_devices, profile, extra_micro_batches, ordered=ordered, topology=topology)
    run.advance(deadline)
    plans, ms, skipped = run.result()
    if times is not None:
        times.update(ms)
    return plans, skipped


class BaselineRun:
    """The static layouts of one batch, planned a few at a time: :meth:`advance` plans layouts until a deadline (the
    planner calls it while its MILP solves run in the solver process, and again after), :meth:`result` gives the
    plans, their predicted times and the layouts not planned. ``ordered``: most promising layouts first (by a lower
    bound on their step time), so that 'batchada' is right even when time cuts the list short. ``topology``: the
    layouts are placed on its nodes and priced where their groups lie."""

    def __init__(
        self, lengths, num_devices: int, profile: Profile, extra_micro_batches: int = 4, ordered=True, topology=None
    ):
        self.lengths = check_batch(lengths, num_devices, profile)
        self.num_devices, self.profile, self.extra = num_devices, profile, extra_micro_batches
        self.topology = topology
        layouts = static_layouts(num_devices)
        if ordered:
            layouts = sorted(
                layouts, key=lambda kd: _layout_bound(self.lengths, num_devices, profile, *kd, topology=topology)
            )
        self.todo = list(layouts)
        self.plans: dict[str, Plan | None] = {f"static-{k}-{d}": None for k, d in static_layouts(num_devices)}
        self.ms: dict[str, float | None] = dict.fromkeys(self.plans)
        self.longest = 0.0

    def advance(self, deadline: float | None, stop=None) -> None:
        """Plan layouts until `deadline` (``time.monotonic()``; None: all) or until ``stop()`` is true: one is started
        only when one more, as long as the longest so far, still ends in time (the first is always planned)."""
        while self.todo:
            t = time.monotonic()
            if deadline is not None and (self.longest > 0 and t + self.longest >= deadline):
                return
            if stop is not None and stop():
                return
            kind, d = self.todo.pop(0)
            name = f"static-{kind}-{d}"
            p = static_plan(
                self.lengths, self.num_devices, self.profile, d, kind, self.extra, deadline=deadline,
                topology=self.topology,
            )  # fmt: skip
            self.plans[name] = p
            self.ms[name] = None if p is None else step_time_ms(p, self.profile)
            self.longest = max(self.longest, time.monotonic() - t)

    def result(self) -> tuple[dict, dict, list[str]]:
        """(name -> Plan or None, name -> predicted ms or None, names not planned), with 'batchada' the best plan."""
        if all(v is None for v in self.plans.values()) and self.todo:
            self._first_feasible()
        feasible = {k: v for k, v in self.plans.items() if v is not None}
        if not feasible:
            raise PlanningError("no static layout can run this batch")  # check_batch makes this unreachable
        best = min(feasible, key=lambda k: self.ms[k])
        plans, ms = dict(self.plans), dict(self.ms)
        plans["batchada"], ms["batchada"] = feasible[best], ms[best]
        return plans, ms, [f"static-{k}-{d}" for k, d in self.todo]

    def _first_feasible(self) -> None:
        """Plan layouts until one runs the batch (every batch check_batch accepts has one)."""
        while self.todo and all(v is None for v in self.plans.values()):
            kind, d = self.todo.pop(0)
            name = f"static-{kind}-{d}"
            p = static_plan(
                self.lengths, self.num_devices, self.profile, d, kind, self.extra, deadline=time.monotonic(),
                topology=self.topology,
            )  # fmt: skip
            self.plans[name] = p
            self.ms[name] = None if p is None else step_time_ms(p, self.profile)


def _layout_bound(lengths, num_devices, profile, kind, degree, topology=None) -> float:
    """A lower bound on the static layout's step time (inf when it cannot run the batch): M_min * O +
    max(total sequence time / groups, the longest sequence's time)."""
    if not kind_allowed(kind, degree, profile):
        return np.inf
    t = _static_type(degree, kind, topology)
    times = time_table(lengths, [t], profile)[:, 0]
    if not np.isfinite(times).all():
        return np.inf
    ng = num_devices // degree
    m_min = math.ceil(int(lengths.sum()) / (ng * profile.group_token_cap(t.kind, degree)))
    return m_min * float(type_overheads([t], profile)[0]) + max(float(times.sum()) / ng, float(times.max()))


def baseline_times_ms(
    lengths,
    num_devices: int,
    profile: Profile,
    extra_micro_batches: int = 4,
    deadline: float | None = None,
    topology=None,
) -> dict:
    """name -> simulated step time in ms (None when that layout cannot run the batch, or was not reached before
    `deadline`)."""
    times: dict = {}
    _baselines(lengths, num_devices, profile, extra_micro_batches, deadline, times, topology=topology)
    return times


def baselines_within(lengths, num_devices: int, profile: Profile, deadline: float) -> tuple[dict, dict, list[str]]:
    """(name -> Plan or None, name -> predicted ms or None, names of the layouts not planned before `deadline`):
    :func:`baseline_plans` with their step times and the layouts it skipped for time."""
    run = BaselineRun(lengths, num_devices, profile)
    run.advance(deadline)
    return run.result()
