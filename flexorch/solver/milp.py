"""The per-micro-batch MILP: how many SP groups of each (degree, kind), and which lengths go to which kind.

Formulation (flexorch's; FlexSP §4.1.1 poses the problem, docs/design.md §2.2 records why its virtual-group MILP is
too symmetric for CBC). The groups of one type are interchangeable, so instead of one binary per (sequence, group)
we decide, for a target makespan C (C'_t = C - O_t of sequence time per group of type t, where O_t = b1 +
latency(t) is the type's fixed cost per micro-batch, `solver.cost_model.group_overhead_ms`):

    n_t   in Z>=0       groups of type t = (d, kind)
    x_bt  in Z>=0       sequences of length-bucket b run by groups of type t     (bucket b: c_b sequences <= s_b)

    sum_t x_bt = c_b                                     every sequence runs once
    sum_b x_bt * time(s_b, t)  <= C'_t * n_t             type t's work fits its groups (fluid balance)
    sum_b x_bt * s_b           <= d_t * cap * n_t        memory of type t's groups
    sum_{b big_2} x_bt <= n_t,  sum_{b big_3} x_bt <= 2 n_t
                       big_k: time > C'_t/k or tokens > d*cap/k (at most k-1 such per group: packing cuts)
    x_bt = 0 if time(s_b, t) > C'_t or d_t < min degree(s_b)
    minimise sum_t d_t n_t                               the devices that makespan C needs
    sum_t a_rt n_t <= K_r                                with a topology: node capacity (``solver.placement``)

For fixed C every constraint is linear; C itself is found by bisection between the area bound and the best
static plan (`solve_micro_batch`). Each MILP starts from a greedy cover (every bucket on its least-area type,
n_t rounded up), so the solver always holds an incumbent and a time-limited answer is still usable. A C is feasible when
the devices needed are <= N; the chosen groups are then packed with real lengths (`lpt_pack`), spare devices
become extra groups, and a local search polishes the result. The plan kept is the best one actually packed.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import mip
import numpy as np

from flexorch.solver import backend
from flexorch.solver.backend import DEFAULT_SOLVER
from flexorch.solver.bucketing import optimal_buckets
from flexorch.solver.exact import MAX_EXACT_SEQUENCES, solve_exact
from flexorch.solver.group_tables import GroupTables
from flexorch.solver.packing import Draft, improve, pack
from flexorch.solver.placement import counts_fit

__all__ = ["MicroBatchSolution", "solve_micro_batch", "best_static_draft"]


@dataclass
class MicroBatchSolution:
    draft: Draft
    makespan_ms: float
    method: str  # "exact" (proven optimal), "milp" (a MILP solution beat the static start), else "static"
    ilp_solves: int
    bisection_steps: int


def best_static_draft(items, types, table, lengths, num_devices, caps_by_type, overheads, polish=True):
    """Best homogeneous layout: floor(N/d) groups of one type, LPT-packed (the per-batch 'BatchAda' choice).

    ``caps_by_type[t]``: tokens a group of type t holds (``solver.packing.type_caps``)."""
    best = None
    for ti, t in enumerate(types):
        if not np.isfinite(table[items, ti]).all():
            continue
        ng = num_devices // t.degree
        gtype = [ti] * ng
        caps = np.full(ng, caps_by_type[ti], dtype=np.int64)
        draft = pack(items, gtype, table, lengths, caps, overheads)
        if draft is not None and (best is None or draft.makespan() < best.makespan()):
            best = draft
    if best is not None and polish:
        caps = np.array([caps_by_type[g] for g in best.group_type], dtype=np.int64)
        best = improve(best, table, lengths, caps, overheads)
    return best


def solve_micro_batch(
    items,
    tables: GroupTables,
    *,
    lower_bound_ms: float,
    time_budget_s: float,
    max_buckets: int = 16,
    tolerance: float = 0.01,
    max_bisection_steps: int = 8,
    ilp_time_limit_s: float = 0.25,
    start: Draft | None = None,
    solver: str = DEFAULT_SOLVER,
) -> MicroBatchSolution | None:
    """Plan one micro-batch (sequences `items`, indices into `tables`) on its N devices; None if none fits.

    Every MILP it solves gets the time left of `time_budget_s` (a bisection step at most `ilp_time_limit_s`), never
    more (`solver.backend.time_left`). `solver`: the MILP backend, 'highs' or 'cbc' (`solver.backend`). A topology's
    node-capacity rows are ``tables.capacity`` (the group counts that keep each type where it is priced).
    """
    deadline = time.perf_counter() + time_budget_s
    backend.check_solver(solver)  # a bad name fails here, also when the greedy cover leaves nothing to solve
    items = list(items)
    types, table, lengths, num_devices = tables.types, tables.table, tables.lengths, tables.num_devices
    caps_by_type, overheads, capacity = tables.caps_by_type, tables.overheads, tables.capacity
    if start is None:
        start = best_static_draft(items, types, table, lengths, num_devices, caps_by_type, overheads)
    else:  # screened by the planner without polish: polish a copy now
        caps = np.array([caps_by_type[g] for g in start.group_type], dtype=np.int64)
        start = improve(copy.deepcopy(start), table, lengths, caps, overheads)
    best = MicroBatchSolution(start, start.makespan(), "static", 0, 0) if start is not None else None
    if len(items) <= MAX_EXACT_SEQUENCES:
        exact = solve_exact(items, tables, time_limit_s=backend.time_left(deadline), start=start, solver=solver)
        if exact is not None and (best is None or exact[0].makespan() <= best.makespan_ms):
            return MicroBatchSolution(exact[0], exact[0].makespan(), "exact" if exact[1] else "milp", 1, 0)
    buckets = _bucket_tables(items, table, lengths, max_buckets)
    pack = (types, table, lengths, num_devices, caps_by_type, overheads)
    limits = (lower_bound_ms, tolerance, max_bisection_steps, ilp_time_limit_s, deadline, solver, capacity)
    best, solves, steps = _bisect(best, buckets, pack, limits)
    if best is None:
        return None  # this micro-batch cannot be packed: the caller splits it further
    best.ilp_solves, best.bisection_steps = solves, steps
    return best


def _bucket_tables(items: list[int], table: np.ndarray, lengths: np.ndarray, max_buckets: int) -> tuple:
    """(members, upper length, count, time on each type) of each length bucket of `items` (``solver.bucketing``)."""
    buckets = optimal_buckets(lengths[items], max_buckets)
    b_items = [[items[j] for j in b.members] for b in buckets]
    b_len = np.array([b.upper for b in buckets], dtype=np.float64)
    b_cnt = np.array([len(m) for m in b_items], dtype=np.int64)
    # time of a bucket's representative (its longest member) on each type; inf where it does not fit
    b_time = np.array([table[max(m, key=lambda i: lengths[i])] for m in b_items])
    return b_items, b_len, b_cnt, b_time


def _bisect(best: MicroBatchSolution | None, buckets: tuple, pack: tuple, limits: tuple):
    """(best solution, MILP solves, bisection steps): the bisection on the makespan c between the lower bound and
    the best so far, each step a MILP for whether the buckets fit in c (:func:`_devices_needed`), a feasible c
    realised as a draft (:func:`_realise`)."""
    b_items, b_len, b_cnt, b_time = buckets
    types, table, lengths, num_devices, caps_by_type, overheads = pack
    lower_bound_ms, tolerance, max_bisection_steps, ilp_time_limit_s, deadline, solver, capacity = limits
    lo = lower_bound_ms
    hi = best.makespan_ms if best is not None else lo * 4
    solves = steps = 0
    while steps < max_bisection_steps and hi > lo * (1 + tolerance) and time.perf_counter() < deadline:
        steps += 1
        c = 0.5 * (lo + hi)
        limit = backend.time_left(deadline, cap=ilp_time_limit_s)
        cp = c - np.asarray(overheads, dtype=np.float64)  # per-type room for sequence time
        counts = _devices_needed(
            cp, types, b_time, b_len, b_cnt, num_devices, caps_by_type, limit, solver=solver, capacity=capacity
        )
        solves += 1
        if counts is None:
            lo = c
            continue
        hi = c
        draft = _realise(counts, types, table, lengths, b_items, num_devices, caps_by_type, overheads, capacity)
        if draft is not None and (best is None or draft.makespan() < best.makespan_ms):
            best = MicroBatchSolution(draft, draft.makespan(), "milp", 0, 0)
    return best, solves, steps


def _devices_needed(
    cp, types, b_time, b_len, b_cnt, n_dev, caps_by_type, time_limit_s, *, solver=DEFAULT_SOLVER, capacity=()
):
    """Solve the MILP at C'_t = cp[t] within `time_limit_s` of the call, on backend `solver`. Returns (n_t, x_bt)
    when it fits on n_dev devices (and the node-capacity rows `capacity`), else None."""
    deadline = time.perf_counter() + time_limit_s
    if not (cp > 0).any():
        return None
    nb, nt = b_time.shape
    # inf (does not fit) compares False, and so does every bucket on a type with cp[t] <= 0
    allowed = (b_time <= cp[None, :]) & _undominated(b_time, types, cp)
    if not allowed.any(axis=1).all():
        return None
    deg = np.array([t.degree for t in types])
    gcap = np.asarray(caps_by_type, dtype=np.int64)  # tokens a group of each type holds
    big2 = allowed & ((b_time > cp[None, :] / 2) | (b_len[:, None] > gcap[None, :] / 2))
    big3 = allowed & ((b_time > cp[None, :] / 3) | (b_len[:, None] > gcap[None, :] / 3))

    # greedy cover for the warm start: each bucket on its least-area allowed type
    area = np.where(allowed, b_time * deg[None, :], np.inf)
    pick = np.argmin(area, axis=1)
    x0 = np.zeros((nb, nt), dtype=np.int64)
    x0[np.arange(nb), pick] = b_cnt
    n0 = _groups_for(x0, b_time, b_len, big2, big3, cp, gcap, allowed)
    if int((n0 * deg).sum()) <= n_dev and counts_fit(n0, capacity):
        return n0, x0  # the greedy cover already fits: no solve needed at this C

    m = backend.new_model(solver)
    n = [m.add_var(var_type=mip.INTEGER, lb=0, ub=max(int(n0[t]), n_dev // deg[t])) for t in range(nt)]
    x = {}
    for b in range(nb):
        for t in np.flatnonzero(allowed[b]):
            x[b, t] = m.add_var(var_type=mip.INTEGER, lb=0, ub=int(b_cnt[b]))
    for b in range(nb):
        m += mip.xsum(x[b, t] for t in np.flatnonzero(allowed[b])) == int(b_cnt[b])
    for t in range(nt):
        bs = np.flatnonzero(allowed[:, t])
        if bs.size == 0:
            continue
        m += mip.xsum(float(b_time[b, t]) * x[b, t] for b in bs) <= float(cp[t]) * n[t]
        m += mip.xsum(float(b_len[b]) * x[b, t] for b in bs) <= float(gcap[t]) * n[t]
        b2 = np.flatnonzero(big2[:, t])
        if b2.size:
            m += mip.xsum(x[b, t] for b in b2) <= n[t]
        b3 = np.flatnonzero(big3[:, t])
        if b3.size:
            m += mip.xsum(x[b, t] for b in b3) <= 2 * n[t]
    for coef, rhs in capacity:  # a topology's node capacity: every type stays where it is priced
        m += mip.xsum(int(coef[t]) * n[t] for t in range(nt) if coef[t]) <= int(rhs)
    m.objective = mip.xsum(int(deg[t]) * n[t] for t in range(nt))
    m.max_mip_gap_abs = 0.999  # the objective is an integer: within 1 is optimal
    m.start = [(n[t], float(n0[t])) for t in range(nt)] + [(v, float(x0[b, t])) for (b, t), v in x.items()]
    if backend.optimize(m, deadline) not in backend.SOLVED:
        return None
    return _solution(n, x, (nb, nt), deg, n_dev, capacity)


def _solution(n, x, shape, deg, n_dev, capacity):
    """(n_t, x_bt) of a solved model, None when its counts do not fit the devices (or the node-capacity rows)."""
    nv = np.array([round(v.x) for v in n], dtype=np.int64)
    if int((nv * deg).sum()) > n_dev or not counts_fit(nv, capacity):
        return None
    xv = np.zeros(shape, dtype=np.int64)
    for (b, t), v in x.items():
        xv[b, t] = round(v.x)
    return nv, xv


def _undominated(b_time, types, cp):
    """(bucket, type) pairs worth a variable: no type of the same or smaller degree runs the bucket as fast.

    A smaller group that is no slower and has at least as much room `cp` (no larger fixed cost) leaves more devices
    for others (and of the same degree, the other attention kind is simply better), so the MILP loses nothing of
    note by not offering the dominated pair. On ranks of different speeds (``solver.speed_levels``) only a type of
    the same or a slower level dominates: a faster level's ranks are scarcer.
    """
    deg = np.array([t.degree for t in types])
    pace = [1.0 if t.speed is None else t.speed for t in types]  # a faster level's ranks are scarcer
    keep = np.ones(b_time.shape, dtype=bool)
    for t in range(len(types)):
        for u in range(len(types)):
            if u == t or cp[u] < cp[t] or pace[u] > pace[t]:
                continue
            if deg[u] < deg[t] or (deg[u] == deg[t] and (pace[u] < pace[t] or u < t)):
                keep[:, t] &= ~(b_time[:, u] <= b_time[:, t])
    return keep


def _groups_for(x, b_time, b_len, big2, big3, cp, gcap, allowed):
    """Fewest groups per type that satisfy every per-type constraint for assignment x."""
    load = (np.where(allowed, b_time, 0.0) * x).sum(axis=0)
    toks = (b_len[:, None] * x).sum(axis=0)
    per = np.divide(load, cp, out=np.zeros_like(load), where=cp > 0)  # no load where cp <= 0 (nothing allowed)
    need = np.maximum(np.ceil(per - 1e-9), np.ceil(toks / gcap - 1e-9))
    need = np.maximum(need, (x * big2).sum(axis=0))
    need = np.maximum(need, np.ceil((x * big3).sum(axis=0) / 2))
    return need.astype(np.int64)


def _realise(counts, types, table, lengths, b_items, n_dev, caps_by_type, overheads, capacity=()):
    """Turn (n_t, x_bt) into groups holding real sequences; spare devices become extra groups (within the node
    capacity rows `capacity`)."""
    n, x = counts
    n = n.copy()
    deg = np.array([t.degree for t in types])
    # assign each bucket's longest members to its largest-degree types
    assigned = {}
    for b, members in enumerate(b_items):
        order = sorted(members, key=lambda i: -lengths[i])
        pos = 0
        for t in sorted(np.flatnonzero(x[b]), key=lambda t: -deg[t]):
            for i in order[pos : pos + x[b, t]]:
                assigned[i] = t
            pos += x[b, t]
    # spare devices: one more group for the type with the heaviest groups that still fits
    load = np.zeros(len(types))
    for i, t in assigned.items():
        load[t] += table[i, t]
    spare = n_dev - int((n * deg).sum())
    while spare > 0:
        per = np.where((n > 0) & (deg <= spare), load / np.maximum(n, 1), -1.0)
        t = int(np.argmax(per))
        if per[t] <= 0:
            break
        n[t] += 1
        if capacity and not counts_fit(n, capacity):  # no room for it where it is priced: not this type again
            n[t] -= 1
            load[t] = 0.0
            continue
        spare -= deg[t]
    gtype = [t for t in range(len(types)) for _ in range(int(n[t]))]
    caps = np.array([caps_by_type[t] for t in gtype], dtype=np.int64)
    masked = np.full_like(table, np.inf)
    for i, t in assigned.items():
        masked[i, t] = table[i, t]
    items = list(assigned)
    draft = pack(items, gtype, masked, lengths, caps, overheads)
    if draft is None:  # memory after rounding: let the packer use any type
        draft = pack(items, gtype, table, lengths, caps, overheads)
        if draft is None:
            return None
    return improve(draft, table, lengths, caps, overheads)
