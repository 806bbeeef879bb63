"""A step's groups on ranks of different speeds: placed by their speeds, then work moved off the slow ones by its price.

A plan's groups are chosen by the MILP (``solver.milp``) with every device at one pace. On ranks of different speeds
(``Topology.speeds``: a throttled GPU, a busy host, a faster GPU kind among slower ones) a group runs at its slowest
member's pace (its collectives wait for it), so a group's time is its nominal time over that speed
(``solver.simulator``). Here, once the groups of every micro-batch are known:

1. each micro-batch's groups are placed heaviest first on the fastest slots (``solver.placement.place``: where a
   slow rank is, the lightest group of a node lies, or none);
2. a rank no group holds in a micro-batch (the placement left a slow one free) gets an empty group of one rank;
3. every placed group becomes a type of its own, its column of the time table and its fixed cost multiplied by its
   pace (1 / the speed of its slowest rank), and the step's local search (``solver.packing.improve_step``: move a
   sequence off the slowest group of the slowest micro-batch while that lowers the step) runs on those prices.
   It moves work from slow groups to fast ones, from a long sequence's slow group to a faster group of any degree
   that holds it, across micro-batches too; a group it empties is dropped, and its ranks sit that micro-batch out
   when that is faster;
4. a rank left idle all step gets the longest sequence it can finish within some micro-batch's time, so the step is
   no longer and its pace is still measured.

So the planner keeps a slow worker out of the heavy groups, gives it fewer or shorter sequences, or none, by the
prices of the cost model and the measured speeds, not by a rule. The answer is priced by the simulator where the
groups lie (``Planner._finish``). Straggler work in practice: Megatron-LM's straggler detector and NVIDIA's
resiliency extension report a slow rank; Hydraulis (arXiv 2412.07894) and HexiScale plan for mixed GPU kinds
statically; this does it per step, from the speeds each worker showed.
"""

from __future__ import annotations

import copy
import time

import numpy as np

from flexorch.solver.bounds import micro_batch_bound_ms
from flexorch.solver.packing import Draft, GroupType, improve_step
from flexorch.solver.placement import place, place_groups
from flexorch.solver.plan import Group, MicroBatch
from flexorch.solver.speed_levels import leveled_step
from flexorch.solver.topology import Topology

__all__ = ["fastest_layout", "leveled_solve", "paced_groups", "placed_micro_batches"]


def placed_micro_batches(
    drafts: list[Draft],
    types: list[GroupType],
    table: np.ndarray,
    lengths: np.ndarray,
    caps_t: np.ndarray,
    overheads: np.ndarray,
    topology: Topology | None,
    *,
    deadline: float | None = None,
) -> list[MicroBatch]:
    """The micro-batches of ``drafts`` on ``topology``: placed by node (``solver.placement.place_groups``), and where
    the ranks have speeds, paced (:func:`paced_groups`). The one way the planner and the baselines lay out a step."""
    if topology is None or topology.uniform_speed:
        return [MicroBatch(tuple(place_groups(d, types, range(len(lengths)), topology))) for d in drafts]
    paced, _ = paced_groups(drafts, types, table, lengths, caps_t, overheads, topology, deadline=deadline)
    return [MicroBatch(tuple(groups)) for groups in paced]


def paced_groups(
    drafts: list[Draft],
    types: list[GroupType],
    table: np.ndarray,
    lengths: np.ndarray,
    caps_t: np.ndarray,
    overheads: np.ndarray,
    topology: Topology,
    *,
    deadline: float | None = None,
) -> tuple[list[list[Group]], float]:
    """The groups of each micro-batch of ``drafts`` (sequence indices into ``table`` / ``lengths``) placed on
    ``topology``'s ranks by their speeds, with the step's local search run on their paced prices (module
    docstring), and the micro-batches' paced makespans summed; micro-batches the moves empty are left out.
    ``deadline``: a ``time.monotonic()`` value the local search stops at (every move keeps the step valid)."""
    placed = []  # per micro-batch: (type index, first rank, members) of each live group
    for d in drafts:
        live = [(t, m, x) for t, m, x in zip(d.group_type, d.members, d.loads, strict=True) if m]
        starts = place([types[t].degree for t, _, _ in live], [types[t].spans for t, _, _ in live], topology,
                       [x for *_, x in live], [types[t].speed for t, _, _ in live])  # fmt: skip
        groups = [(t, s, list(m)) for (t, m, _), s in zip(live, starts, strict=True)]
        placed.append(groups + _free_slots(groups, types, topology))
    flat = [g for mb in placed for g in mb]
    if not flat:
        return [], 0.0
    # every placed group its own type: its column and fixed cost at its pace (1 / its slowest rank's speed)
    pace = np.array([1.0 / topology.speed_of(range(s, s + types[t].degree)) for t, s, _ in flat])
    own = np.array([t for t, _, _ in flat], dtype=np.int64)
    paced_table = table[:, own] * pace[None, :]
    paced_fixed = np.asarray(overheads, dtype=np.float64)[own] * pace
    caps = np.asarray(caps_t, dtype=np.int64)[own]
    paced_drafts, cap_rows, j = [], [], 0
    for mb in placed:
        ids = list(range(j, j + len(mb)))
        members = [list(m) for _, _, m in mb]
        loads = np.array([paced_fixed[g] + paced_table[m, g].sum() if m else 0.0
                          for g, m in zip(ids, members, strict=True)])  # fmt: skip
        tokens = np.array([int(lengths[m].sum()) for m in members], dtype=np.int64)
        paced_drafts.append(Draft(ids, members, loads, tokens))
        cap_rows.append(caps[ids])
        j += len(mb)
    moves = max(400, 4 * len(lengths))
    improve_step(paced_drafts, cap_rows, paced_table, lengths, paced_fixed, max_moves=moves, deadline=deadline)
    spans = [[(s, types[t].degree) for t, s, _ in mb] for mb in placed]
    _probe_idle(spans, paced_drafts, cap_rows, paced_table, lengths, paced_fixed)
    out = []
    for mb, d in zip(placed, paced_drafts, strict=True):
        groups = [
            Group(types[t].degree, types[t].kind, tuple(range(s, s + types[t].degree)), tuple(int(i) for i in m),
                  types[t].ulysses_degree)
            for (t, s, _), m in zip(mb, d.members, strict=True)
            if m
        ]  # fmt: skip
        if groups:
            out.append(sorted(groups, key=lambda g: g.ranks[0]))
    return out, float(sum(d.makespan() for d in paced_drafts))


def _probe_idle(spans, drafts: list[Draft], caps: list[np.ndarray], table, lengths, fixed) -> None:
    """A rank the local search left idle all step gets the longest sequence it can finish within some
    micro-batch's time, taken from another group of that micro-batch (which only gets shorter), so the step is no
    longer and the rank's pace is still measured: an idle worker says nothing (``solver.worker_speeds``), drifts
    back toward its old speed and is then given much more to find out. ``spans``: each micro-batch's groups'
    (first rank, degree), in the drafts' order; the drafts are changed in place."""
    busy: set[int] = set()
    for sp, d in zip(spans, drafts, strict=True):
        for (s, deg), m in zip(sp, d.members, strict=True):
            if m:
                busy.update(range(s, s + deg))
    idle = sorted(
        {s for sp, d in zip(spans, drafts, strict=True) for (s, deg), m in zip(sp, d.members, strict=True) if not m}
        - busy
    )  # the free slots (of one rank each) of ranks no group used
    for r in idle:
        best = None  # (time on r, micro-batch, from group, to group, sequence)
        for k, (sp, d) in enumerate(zip(spans, drafts, strict=True)):
            h = next((h for h, ((s, deg), m) in enumerate(zip(sp, d.members, strict=True)) if s == r and deg == 1
                      and not m), None)  # fmt: skip
            if h is None:
                continue
            col, span = d.group_type[h], d.makespan()
            for g, m in enumerate(d.members):
                for i in m if g != h else ():
                    took = fixed[col] + table[i, col]
                    if took <= span and lengths[i] <= caps[k][h] and (best is None or took > best[0]):
                        best = (took, k, g, h, i)
        if best is None:
            continue
        took, k, g, h, i = best
        d = drafts[k]
        d.members[g].remove(i)
        d.loads[g] = d.loads[g] - table[i, d.group_type[g]] if d.members[g] else 0.0
        d.tokens[g] -= lengths[i]
        d.members[h].append(i)
        d.loads[h], d.tokens[h] = took, lengths[i]


def _free_slots(groups, types: list[GroupType], topology: Topology) -> list[tuple[int, int, list]]:
    """An empty group of one rank on each rank no group of the micro-batch holds (``(type, rank, [])``), so the local
    search can give a rank the placement left free (a slow one: ``solver.placement.place``) a share it can finish
    in time, or leave it idle; none where the types have no group of one rank."""
    single = [t for t, gt in enumerate(types) if gt.degree == 1]
    if not single:
        return []
    held = {r for t, s, _ in groups for r in range(s, s + types[t].degree)}
    return [(single[0], r, []) for r in range(topology.num_devices) if r not in held]


def leveled_solve(step, drafts: list[Draft], solves, until: float, run: dict, idle=None):
    """The micro-batches of ``drafts`` (the step's best split, planned at one pace) solved again by the MILP with
    each type once per speed level (``solver.speed_levels``), from ``drafts`` as starts (each group at the slowest
    level: it may lie anywhere), by ``until``: ``(drafts, types, table, caps, overheads)`` with the leveled types,
    their table and fixed costs nominal (the layout paces them, :func:`fastest_layout` picks), or None when some
    micro-batch could not be packed. ``solves``: the planner's ``SplitSolver`` (its solver process and deadlines)."""
    leveled, base_of = leveled_step(step)
    lowest: dict[int, int] = {}
    for j, t in enumerate(base_of):
        lowest.setdefault(int(t), j)  # the levels of a type come slowest first
    split, starts, bounds = [], [], []
    fastest = max(step.topology.rank_speeds())
    for d in drafts:
        gtype = [lowest[t] for t in d.group_type]
        members = [list(m) for m in d.members]
        loads = np.array([leveled.overheads[g] + leveled.table[m, g].sum() if m else 0.0
                          for g, m in zip(gtype, members, strict=True)])  # fmt: skip
        starts.append(Draft(gtype, members, loads, d.tokens.copy()))
        items = sorted(i for m in members for i in m)
        split.append(items)
        bounds.append(micro_batch_bound_ms(step.table[items], step.deg, step.n, step.overheads) / fastest)
    sols, _ = solves.solve(leveled, split, bounds, until, starts, run, until, idle)
    if sols is None:
        return None
    return [d for d, _ in sols], leveled.types, step.table[:, base_of], leveled.caps_t, step.overheads[base_of]


def fastest_layout(layouts: list[tuple], lengths: np.ndarray, topology: Topology | None, make_plan, price, *,
                   deadline: float | None = None):  # fmt: skip
    """The fastest plan (by ``price(plan)``) of the ``layouts`` (each ``(drafts, types, table, caps, overheads)``,
    the first the step's best split at one pace) laid out on ``topology`` (:func:`placed_micro_batches`; the local
    search of each stops by its share of the time to ``deadline``); on ranks of different speeds also the first
    placed as the speed-blind planner places it, so a speed-aware plan is never priced slower than the blind
    layout of its own split. ``make_plan(micro_batches)`` makes the plan."""
    if topology is None or topology.uniform_speed:
        drafts, types, table, caps, overheads = layouts[0]
        return make_plan(placed_micro_batches(drafts, types, table, lengths, caps, overheads, topology))
    blind = topology.without_speeds()
    drafts, types = layouts[0][0], layouts[0][1]
    plans = [make_plan([MicroBatch(tuple(place_groups(d, types, range(len(lengths)), blind))) for d in drafts])]
    for k, (drafts, types, table, caps, overheads) in enumerate(layouts):
        until = None
        if deadline is not None:
            until = time.monotonic() + max(0.0, deadline - time.monotonic()) / (len(layouts) - k)
        # a copy: the local search moves the members in place
        mbs = placed_micro_batches(
            copy.deepcopy(drafts), types, table, lengths, caps, overheads, topology, deadline=until
        )
        plans.append(make_plan(mbs))
    return min(plans[::-1], key=price)  # ties: the paced layouts
