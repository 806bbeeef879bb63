"""A fast heterogeneous packing of one micro-batch: groups of mixed (degree, kind) chosen while packing.

The MILP (``solver.milp``) chooses how many groups of each type a micro-batch gets, on length buckets, and is the
planner's best tool when it has time; the static start (``packing.best_homogeneous_draft``) gives every group the
same type and is what a micro-batch keeps when the MILP does not come back. Between the two, this packer builds a
mixed layout in milliseconds, so every micro-batch of every candidate split gets a good plan before any MILP runs.

For a target makespan C it is first-fit decreasing bin packing whose bins are opened on the way (the bin-packing
view of FlexSP §4.1.1: groups are bins of time C - O_t and memory C_t tokens, O_t the type's fixed cost):

    sequences hardest first (least wall time over the types that hold them, descending)
    each goes to the open group with the least room left after it (best fit) that has time and memory for it;
    where none has, it opens a group of the type where it costs the least device-time d_t * t(s, t) and that
    still fits the devices left; where none fits, C is infeasible.

C is found by bisection between a lower bound and a plan in hand (the packer is not monotone in C, so the best
packed draft seen is kept, not the last). Spare devices then become extra groups of the busiest types and the local
search (``packing.improve``) balances the loads, which also lowers the makespan below C.
"""

from __future__ import annotations

import time

import numpy as np

from flexorch.solver.group_tables import GroupTables
from flexorch.solver.packing import Draft, improve

__all__ = ["fill_pack", "fill_draft"]


def fill_pack(
    items,
    degrees: np.ndarray,
    table: np.ndarray,
    lengths: np.ndarray,
    num_devices: int,
    caps_by_type: np.ndarray,
    overheads: np.ndarray,
    target_ms: float,
    order: list[int] | None = None,
    tight: bool = False,
) -> Draft | None:
    """Pack `items` into groups opened on the way so that no group exceeds `target_ms`; None when that needs more
    than `num_devices` devices (or some sequence fits no type within it). Groups are in the order opened.

    A group is opened with the type where the sequence costs the least device-time, or with `tight` (for
    micro-batches whose memory is the limit) the smallest degree that holds it, least device-time among those."""
    items = list(items)
    if order is None:
        order = _hardest_first(items, table, overheads)
    sub = table[order]  # (k, types)
    fixed = np.asarray(overheads, dtype=np.float64)
    caps = np.asarray(caps_by_type, dtype=np.int64)
    deg = np.asarray(degrees, dtype=np.int64)
    area = sub * deg[None, :]  # device-ms of each sequence on each type (inf where it does not fit)
    if tight:  # the smallest degree first, then the least device-time: the degree dominates the key
        scale = 1.0 + float(np.max(area, where=np.isfinite(area), initial=0.0))
        area = deg[None, :] * scale + area
    lens = lengths[order]
    opens = (fixed[None, :] + sub <= target_ms) & (lens[:, None] <= caps[None, :])
    k = len(order)
    gt_a = np.zeros(k, dtype=np.int64)  # at most one group per sequence: the first ng entries are the groups
    load_a = np.zeros(k)
    tok_a = np.zeros(k, dtype=np.int64)
    room = np.zeros(k, dtype=np.int64)  # tokens each group still holds
    members: list[list[int]] = []
    ng = 0
    left = int(num_devices)
    for row, (i, s) in enumerate(zip(order, lens.tolist(), strict=True)):
        if ng:
            after = load_a[:ng] + sub[row, gt_a[:ng]]
            fits = (after <= target_ms) & (room[:ng] >= s)
            if fits.any():
                g = int(np.argmax(np.where(fits, after, -np.inf)))  # best fit: the least time left after it
                load_a[g] = after[g]
                tok_a[g] += s
                room[g] -= s
                members[g].append(i)
                continue
        can = opens[row] & (deg <= left)
        if not can.any():
            return None
        u = int(np.argmin(np.where(can, area[row], np.inf)))
        members.append([i])
        left -= int(deg[u])
        gt_a[ng], load_a[ng], tok_a[ng], room[ng] = u, fixed[u] + sub[row, u], s, caps[u] - s
        ng += 1
    return Draft(gt_a[:ng].tolist(), members, load_a[:ng].copy(), tok_a[:ng].copy())


def fill_draft(
    items,
    tables: GroupTables,
    *,
    lower_ms: float,
    upper_ms: float,
    tolerance: float = 0.01,
    max_steps: int = 10,
    deadline: float | None = None,
) -> Draft | None:
    """The best `fill_pack` of the micro-batch `items` (indices into `tables`) over a bisection of the target in
    [lower_ms, upper_ms] (`upper_ms`: the makespan of a plan in hand, e.g. the static start), then its spare devices
    added as groups and the loads balanced by local search.
    None when no target packed. Past `deadline` (``time.monotonic()``) no further target is tried."""
    items = list(items)
    if not items:
        return None
    table, lengths, num_devices = tables.table, tables.lengths, tables.num_devices
    caps_by_type, overheads = tables.caps_by_type, tables.overheads
    deg = np.array([t.degree for t in tables.types], dtype=np.int64)
    order = _hardest_first(items, table, overheads)
    best: Draft | None = None
    lo, hi = float(lower_ms), float(upper_ms)
    steps = 0
    c = hi
    while steps < max_steps:
        steps += 1
        got = fill_pack(items, deg, table, lengths, num_devices, caps_by_type, overheads, c, order)
        if got is None:  # memory may be what failed: open the smallest groups that hold each sequence
            got = fill_pack(items, deg, table, lengths, num_devices, caps_by_type, overheads, c, order, tight=True)
        if got is not None:
            if best is None or got.makespan() < best.makespan():
                best = got
            hi = min(c, got.makespan())
        else:
            lo = c
        if hi <= lo * (1 + tolerance) or (deadline is not None and time.monotonic() >= deadline):
            break
        c = 0.5 * (lo + hi)
    if best is None:
        return None
    return _finish(best, deg, table, lengths, num_devices, caps_by_type, overheads)  # the best target's packing


def _hardest_first(items: list[int], table: np.ndarray, overheads) -> list[int]:
    """Items by their least wall time (the type's fixed cost included) over the types that hold them, longest first."""
    wall = np.min(table[items] + np.asarray(overheads, dtype=np.float64)[None, :], axis=1)
    return [items[j] for j in np.argsort(-wall, kind="stable")]


def _finish(draft: Draft, deg, table, lengths, num_devices, caps_by_type, overheads) -> Draft:
    """Spare devices as extra (empty) groups of the types whose groups are the most loaded, then the local search."""
    spare = int(num_devices) - int(deg[draft.group_type].sum())
    gt = list(draft.group_type)
    per = np.zeros(deg.size)
    cnt = np.zeros(deg.size)
    for g, t in enumerate(gt):
        per[t] += draft.loads[g]
        cnt[t] += 1
    extra = []
    while spare > 0:
        avg = np.where((cnt > 0) & (deg <= spare), per / np.maximum(cnt, 1), -1.0)
        t = int(np.argmax(avg))
        if avg[t] <= 0:
            break
        extra.append(t)
        cnt[t] += 1
        spare -= int(deg[t])
    k = len(extra)
    out = Draft(
        gt + extra,
        draft.members + [[] for _ in range(k)],
        np.concatenate([draft.loads, np.zeros(k)]),
        np.concatenate([draft.tokens, np.zeros(k, dtype=np.int64)]),
    )
    caps = np.asarray(caps_by_type, dtype=np.int64)[np.asarray(out.group_type, dtype=np.int64)]
    return improve(out, table, lengths, caps, overheads, max_moves=max(200, 2 * len(draft.group_type)))
