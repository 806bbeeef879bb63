"""Placing one micro-batch's SP groups on the cluster's nodes (``solver.topology``), and the node-capacity rows the
MILP prices placements with.

**Which groups lie inside a node.** Group degrees are powers of two, so they divide each other, and a set of groups
of degree <= the largest node fits inside the nodes (bins = the nodes' free ranks) iff for every power of two d

    sum over groups of degree d' >= d of d'   <=   sum over nodes of d * floor(size / d)      (``intra_capacity``)

(necessary: the groups of degree >= d in one node use a multiple of d of its ranks; sufficient: placed largest
first, anywhere they fit, every free run keeps a length whose d-multiples count the d-slots left, so each group of
degree d finds one while the inequality holds -- the buddy allocator's argument; a node of 7 holds 4 + 2 + 1).

**The MILP's rows** (:func:`capacity_rows`): types of degree > the largest node must span nodes (priced with the
inter-node tables, ``GroupType.spans``); every other type is priced inside a node, and the rows above keep the chosen
counts placeable so, a spanning group counted with its whole degree in every row (it takes whole nodes first, so it
takes at most its degree of any row's capacity). Rows that cannot bind (capacity >= N: nodes of one power-of-two
size) are left out, so a cluster of whole nodes adds no row, and one short node adds at most log2(node size) rows of
one coefficient per type: the solve keeps its size.

**The placement** (:func:`place`): groups that must span first, largest first, each on the run of consecutive free
nodes that holds it with the fewest ranks left over (whole nodes first; a hybrid group's ring positions then lie
in nodes); then the others largest first, each best-fit into a node's free run. A group that finds no room where it
was priced is put on any free window of consecutive ranks (it then spans, and the plan prices it so: the simulator
prices every group by where it lies); when even that fails the groups take consecutive ranks from 0 (as without a
topology), priced where they lie.

**Ranks of different speeds** (``Topology.speeds``): a group runs at its slowest member's pace, so the groups are
placed heaviest first (by their loads, within the order above), each on the free slot whose slowest rank is fastest:
any run that holds it (fewest ranks left over among equally fast ones), at an offset of a multiple of its degree
from the run's start. Such an offset leaves the run's slots of every smaller power of two as many as the start does
(the prefix is a multiple of the degree, which they divide), so the capacity argument above still holds. Without
speeds every slot is as fast and this is the best fit at the run's start described above. The slow
ranks then hold the lightest groups, or none; ``solver.paced`` moves work off them by its prices. A group priced
at a speed level (``levels``, ``solver.speed_levels``) takes the slowest slot at least that fast instead.
"""

from __future__ import annotations

import numpy as np

from flexorch.solver.packing import Draft, GroupType, layout_groups
from flexorch.solver.plan import Group
from flexorch.solver.topology import Topology

__all__ = ["capacity_rows", "place", "place_groups", "counts_fit"]


def capacity_rows(degrees, spans, topology: Topology | None) -> tuple[tuple[tuple[int, ...], int], ...]:
    """((coefficient per type, capacity), ...): ``sum_t coef[t] * n_t <= capacity`` for each power of two d <= the
    largest node whose ``intra_capacity(d)`` is below N; ``coef[t]`` is the degree of type t where it counts (a type
    inside nodes of degree >= d, or any spanning type), else 0. Empty without a topology."""
    if topology is None:
        return ()
    n = topology.num_devices
    rows = []
    d = 1
    while d <= topology.max_node_size:
        cap = topology.intra_capacity(d)
        if cap < n:
            coef = tuple(int(g) if (s or g >= d) else 0 for g, s in zip(degrees, spans, strict=True))
            rows.append((coef, cap))
        d *= 2
    return tuple(rows)


def counts_fit(counts, rows) -> bool:
    """Whether group counts per type (``n_t``) satisfy every capacity row."""
    c = np.asarray(counts, dtype=np.int64)
    return all(int(np.dot(np.asarray(coef, dtype=np.int64), c)) <= cap for coef, cap in rows)


def place(degrees, spans, topology: Topology, loads=None, levels=None) -> list[int]:
    """The first rank of each group (``degrees[g]`` consecutive ranks from there); ``spans[g]``: the group is priced
    as spanning nodes (placed first, on whole nodes). ``loads[g]``: the group's time, which places the heavier of
    equal groups on the faster ranks where the topology has speeds. ``levels[g]``: the speed group g was priced at
    (``GroupType.speed``; None: any): placed faster levels first, each on the slowest slot at least that fast (the
    faster slots kept for the faster levels). Never fails: see the module docstring."""
    n = topology.num_devices
    if sum(degrees) > n:
        raise ValueError(f"groups of {sum(degrees)} ranks do not fit {n} devices")
    free = [[(a, a + s)] for a, s in zip(topology.node_starts, topology.node_sizes, strict=True)]
    start = [-1] * len(degrees)
    weight = [0.0] * len(degrees) if loads is None or topology.uniform_speed else [-float(x) for x in loads]
    speeds = None if topology.uniform_speed else topology.speeds
    level = [None] * len(degrees) if levels is None or speeds is None else list(levels)
    order = sorted(range(len(degrees)), key=lambda g: (not spans[g], -degrees[g], -(level[g] or 0.0), weight[g], g))
    for g in order:
        d = degrees[g]
        if spans[g]:
            s = _whole_nodes(free, topology, d, speeds, level[g])
        else:
            s = _best_fit(free, d, speeds, level[g])
        if s is None:
            s = _window(free, d)
        if s is None:  # fragmented: consecutive ranks from 0, as without a topology
            return _consecutive(degrees)
        _take(free, topology, s, d)
        start[g] = s
    return start


def _consecutive(degrees) -> list[int]:
    out, r = [0] * len(degrees), 0
    for g in sorted(range(len(degrees)), key=lambda g: (-degrees[g], g)):
        out[g] = r
        r += degrees[g]
    return out


def _slot_key(pace: float, level: float | None) -> tuple:
    """How a slot whose slowest rank has speed ``pace`` ranks for a group priced at ``level`` (lower first): for a
    level, the slowest slot at least that fast, then any slot fastest first; without one, the fastest."""
    if level is None:
        return (0, -pace)
    return (0, pace) if pace >= level - 1e-9 else (1, -pace)


def _whole_nodes(free, topology: Topology, d: int, speeds=None, level=None) -> int | None:
    """First rank of the run of consecutive wholly free nodes that holds d ranks with the fewest left over (with
    ``speeds``: the fastest such run first, its slowest rank counting; with a ``level``: :func:`_slot_key`)."""
    whole = [len(f) == 1 and f[0] == (a, a + s) for f, a, s in zip(free, topology.node_starts, topology.node_sizes,
                                                                       strict=True)]  # fmt: skip
    best = None
    for i in range(topology.num_nodes):
        total, j = 0, i
        while j < topology.num_nodes and whole[j] and total < d:
            total += topology.node_sizes[j]
            j += 1
        if total >= d:
            a = topology.node_starts[i]
            key = (*(_slot_key(min(speeds[a : a + d]), level) if speeds else ()), total - d)
            if best is None or key < best[0]:
                best = (key, a)
    return None if best is None else best[1]


def _best_fit(free, d: int, speeds=None, level=None) -> int | None:
    """Start of the smallest free run inside one node that holds d ranks (ties: the lowest rank). With ``speeds``:
    the slot (a run, at an offset of a multiple of d from its start) whose slowest rank is fastest (with a
    ``level``: :func:`_slot_key`), then the smallest run, then the lowest rank."""
    best = None
    for runs in free:
        for a, b in runs:
            if b - a < d:
                continue
            offsets = range(a, b - d + 1, d) if speeds else (a,)
            for s in offsets:
                key = (*(_slot_key(min(speeds[s : s + d]), level) if speeds else ()), b - a, s)
                if best is None or key < best:
                    best = key
    return None if best is None else best[-1]


def _window(free, d: int) -> int | None:
    """Start of the first d consecutive free ranks, across node boundaries."""
    runs = sorted(r for f in free for r in f)
    a0 = b0 = None
    for a, b in runs:
        if b0 is not None and a == b0:
            b0 = b
        else:
            a0, b0 = a, b
        if b0 - a0 >= d:
            return a0
    return None


def _take(free, topology: Topology, s: int, d: int) -> None:
    lo, hi = s, s + d
    for i, runs in enumerate(free):
        a_node = topology.node_starts[i]
        if a_node >= hi or a_node + topology.node_sizes[i] <= lo:
            continue
        out = []
        for a, b in runs:
            if b <= lo or a >= hi:
                out.append((a, b))
                continue
            if a < lo:
                out.append((a, lo))
            if b > hi:
                out.append((hi, b))
        free[i] = out


def place_groups(draft: Draft, types: list[GroupType], seq_ids, topology: Topology | None) -> list[Group]:
    """:func:`layout_groups` on a topology (``solver.placement.place``): groups of a type priced inside a node lie
    inside one where the node capacity allows, spanning types take whole nodes first. Without a topology: exactly
    :func:`layout_groups`."""
    if topology is None:
        return layout_groups(draft, types, seq_ids)
    seq_ids = list(seq_ids)
    live = [(types[t], m, x) for t, m, x in zip(draft.group_type, draft.members, draft.loads, strict=True) if m]
    starts = place([t.degree for t, _, _ in live], [t.spans for t, _, _ in live], topology, [x for *_, x in live])
    order = sorted(range(len(live)), key=lambda g: starts[g])
    return [
        Group(
            live[g][0].degree,
            live[g][0].kind,
            tuple(range(starts[g], starts[g] + live[g][0].degree)),
            tuple(seq_ids[i] for i in live[g][1]),
            live[g][0].ulysses_degree,
        )
        for g in order
    ]
