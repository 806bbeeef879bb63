"""Exact plan of a small micro-batch: one binary per (sequence, group slot), solved to optimality by the MILP backend
(``solver.backend``: HiGHS or CBC).

This is FlexSP's virtual-group formulation (§4.1.1: binary assignment A[k,p], binary group use m[p], makespan C),
with symmetry broken by using the slots of a type in order. It is too symmetric for big micro-batches (docs/design.md
§2.2) but exact and fast for a handful of sequences, which is what sorted Blaster splits often produce for the
longest sequences: the planner uses it up to `MAX_EXACT_SEQUENCES` sequences per micro-batch.

    min C   s.t.  sum_{t,j} y[i,t,j] = 1                        every sequence in one group slot
                  y[i,t,j] <= u[t,j],  u[t,j] >= u[t,j+1]        slots used in order
                  O_t*u[t,j] + sum_i time(i,t)*y[i,t,j] <= C    group time (O_t = b1 + latency of type t)
                  sum_i s_i*y[i,t,j] <= d_t*cap*u[t,j]          group memory
                  sum_{t,j} d_t*u[t,j] <= N                     devices
"""

from __future__ import annotations

import time

import mip
import numpy as np

from flexorch.solver import backend
from flexorch.solver.backend import DEFAULT_SOLVER
from flexorch.solver.group_tables import GroupTables
from flexorch.solver.packing import Draft

__all__ = ["MAX_EXACT_SEQUENCES", "solve_exact"]

MAX_EXACT_SEQUENCES = 8


def solve_exact(
    items,
    tables: GroupTables,
    *,
    time_limit_s: float,
    start: Draft | None = None,
    solver: str = DEFAULT_SOLVER,
):
    """(draft, proven_optimal) for the micro-batch `items` (indices into `tables`), or None when the solver found
    nothing in time. `time_limit_s` counts from the call (building the model included); `solver`: the MILP backend,
    'highs' or 'cbc' (`solver.backend`); the node-capacity rows of a topology are ``tables.capacity``.
    """
    deadline = time.perf_counter() + time_limit_s
    items = list(items)
    types, table, lengths, num_devices = tables.types, tables.table, tables.lengths, tables.num_devices
    caps_by_type, overheads, capacity = tables.caps_by_type, tables.overheads, tables.capacity
    deg = [t.degree for t in types]
    m = backend.new_model(solver)
    slots = {t: min(len(items), num_devices // deg[t]) for t in range(len(types))}
    u = {(t, j): m.add_var(var_type=mip.BINARY) for t in slots for j in range(slots[t])}
    y = {}
    for i in items:
        for t in slots:
            if np.isfinite(table[i, t]):
                for j in range(slots[t]):
                    y[i, t, j] = m.add_var(var_type=mip.BINARY)
    c = m.add_var(lb=0.0)
    for i in items:
        m += mip.xsum(v for (ii, _, _), v in y.items() if ii == i) == 1
    for (t, j), uv in u.items():
        mine = [(i, v) for (i, tt, jj), v in y.items() if tt == t and jj == j]
        for _, v in mine:
            m += v <= uv
        if j + 1 < slots[t]:
            m += uv >= u[t, j + 1]
        m += float(overheads[t]) * uv + mip.xsum(float(table[i, t]) * v for i, v in mine) <= c
        m += mip.xsum(float(lengths[i]) * v for i, v in mine) <= int(caps_by_type[t]) * uv
    m += mip.xsum(deg[t] * uv for (t, _), uv in u.items()) <= num_devices
    for coef, rhs in capacity:  # a topology's node capacity (``solver.placement.capacity_rows``)
        m += mip.xsum(int(coef[t]) * uv for (t, _), uv in u.items() if coef[t]) <= int(rhs)
    m.objective = c
    if start is not None and (values := _start_values(start, u, y, c)):
        m.start = values  # HiGHS completes a start with zeros: exactly the slots and pairs the draft leaves unused
    status = backend.optimize(m, deadline)
    if status not in backend.SOLVED:
        return None
    return _draft(u, y, table, lengths, overheads), status == mip.OptimizationStatus.OPTIMAL


def _draft(u, y, table, lengths, overheads) -> Draft:
    """The groups a solved model opened and the sequences each runs."""
    gtype, members = [], []
    for (t, j), uv in u.items():
        if uv.x >= 0.5:
            gtype.append(t)
            members.append([i for (i, tt, jj), v in y.items() if tt == t and jj == j and v.x >= 0.5])
    loads = np.array(
        [overheads[t] + sum(table[i, t] for i in mem) if mem else 0.0 for t, mem in zip(gtype, members, strict=True)]
    )
    tokens = np.array([int(sum(lengths[i] for i in mem)) for mem in members], dtype=np.int64)
    return Draft(gtype, members, loads, tokens)


def _start_values(draft: Draft, u, y, c):
    used: dict[int, int] = {}
    vals = []
    for t, mem in zip(draft.group_type, draft.members, strict=True):
        if not mem:
            continue
        j = used.get(t, 0)
        used[t] = j + 1
        if (t, j) not in u:
            return []
        vals.append((u[t, j], 1.0))
        for i in mem:
            if (i, t, j) not in y:
                return []
            vals.append((y[i, t, j], 1.0))
    vals.append((c, float(draft.makespan())))
    return vals
