"""The MILP's group types on ranks of different speeds: each type once per speed level, priced at that level, and the
rows that keep the faster levels within the ranks fast enough to hold them.

The micro-batch MILP (``solver.milp``) decides how many groups of each type run and which sequences go to each type;
its types are interchangeable groups. On ranks of different speeds (``Topology.speeds``) a group's time is its
nominal time over its slowest member's speed (``solver.simulator``), so groups of one (degree, kind) are no longer
interchangeable: one on fast ranks is a different resource than one holding a slow rank. The levels
(:func:`speed_levels`: the distinct speeds, at most ``MAX_LEVELS``, a speed rounded down to the level below it) make
them types again: type (d, kind) at level v is a group of d ranks each at least v fast, priced at v (its table column
and fixed cost divided by v). The slowest level's types lie anywhere (the nominal types priced pessimistically).

**Rows.** Ranks at least v fast form runs of consecutive ranks inside each node; groups of levels >= v must lie in
them, so, as for nodes (``solver.placement``: the buddy argument on power-of-two degrees), for every level v above
the slowest and every power of two d:

    sum over types of level >= v and degree >= d (or spanning) of degree * n_t  <=  d * sum over runs of floor(len/d)

added to the node-capacity rows; the MILP then chooses, by its prices, to run a long sequence's group on fast ranks,
to give the group that holds a slow rank less or shorter work, or to leave a slow rank out of a micro-batch. The
placement puts each group on the slowest slot at least as fast as its level (``placement.place`` with ``levels``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flexorch.solver.placement import capacity_rows
from flexorch.solver.step_tables import StepTables
from flexorch.solver.topology import Topology

__all__ = ["MAX_LEVELS", "leveled_step", "level_rows", "speed_levels"]

MAX_LEVELS = 4
"""The most speed levels the MILP's types are made for (each multiplies its types)."""


def speed_levels(topology: Topology, max_levels: int = MAX_LEVELS) -> tuple[float, ...]:
    """The distinct speeds of the ranks, ascending; more than ``max_levels``: the two closest adjacent levels merged
    into the lower (a rank is then priced at most that much slower than it is)."""
    levels = sorted(set(topology.rank_speeds()))
    while len(levels) > max_levels:
        gaps = [levels[i + 1] / levels[i] for i in range(len(levels) - 1)]
        del levels[int(np.argmin(gaps)) + 1]
    return tuple(levels)


def _runs(topology: Topology, level: float) -> list[int]:
    """Lengths of the maximal runs of consecutive ranks at least ``level`` fast inside each node."""
    speeds = topology.rank_speeds()
    out = []
    for a, n in zip(topology.node_starts, topology.node_sizes, strict=True):
        run = 0
        for r in range(a, a + n):
            if speeds[r] >= level - 1e-9:
                run += 1
            elif run:
                out.append(run)
                run = 0
        if run:
            out.append(run)
    return out


def _whole_node_ranks(topology: Topology, level: float) -> int:
    """The most ranks of consecutive whole nodes all at least ``level`` fast (what a spanning group may take)."""
    speeds = topology.rank_speeds()
    best = run = 0
    for a, n in zip(topology.node_starts, topology.node_sizes, strict=True):
        run = run + n if min(speeds[a : a + n]) >= level - 1e-9 else 0
        best = max(best, run)
    return best


def level_rows(types, topology: Topology, levels) -> tuple[tuple[tuple[int, ...], int], ...]:
    """The rows of the module docstring for every level above the slowest (``types[t].speed``: type t's level)."""
    rows = []
    for v in levels[1:]:
        runs = _runs(topology, v)
        d = 1
        while runs and d <= max(runs):
            coef = tuple(
                int(t.degree) if t.speed >= v - 1e-9 and (t.spans or t.degree >= d) else 0 for t in types
            )  # fmt: skip
            if any(coef):
                rows.append((coef, d * sum(x // d for x in runs)))
            d *= 2
    return tuple(rows)


def leveled_step(step: StepTables) -> tuple[StepTables, np.ndarray]:
    """``step`` with every type once per speed level its ranks allow (module docstring), priced at that level, and
    the node and level rows; and, per leveled type, the index of the type it copies. ``step.topology`` has speeds."""
    topology = step.topology
    levels = speed_levels(topology)
    types, base = [], []
    for t, gt in enumerate(step.types):
        for v in levels:
            room = _whole_node_ranks(topology, v) if gt.spans else max(_runs(topology, v), default=0)
            if v == levels[0] or room >= gt.degree:
                types.append(dataclasses.replace(gt, speed=float(v)))
                base.append(t)
    base_of = np.asarray(base, dtype=np.int64)
    pace = np.array([1.0 / t.speed for t in types])
    table = step.table[:, base_of] * pace[None, :]
    overheads = step.overheads[base_of] * pace
    rows = capacity_rows([t.degree for t in types], [t.spans for t in types], topology)
    leveled = dataclasses.replace(
        step,
        types=types,
        caps_t=step.caps_t[base_of],
        table=table,
        overheads=overheads,
        deg=step.deg[base_of],
        capacity=rows + level_rows(types, topology, levels),
    )
    return leveled, base_of
