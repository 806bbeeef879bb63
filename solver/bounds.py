"""Proven lower bounds on a step's (or a micro-batch's) makespan under the cost model.

Area (LP-relaxation) bound. Let a(s) = min over feasible groups (d, kind) of d * t(s, d, kind): the least
device-time sequence s can cost, and tmin(s) the least wall time it can take. In any plan, a micro-batch m lasts
at least b1 + max_g load_g, and max_g load_g >= (sum_g d_g load_g) / N >= (sum_{s in m} a(s)) / N, and also
>= tmin(s) for every s in m. Summing over micro-batches, and since memory forces at least
M_min = ceil(total tokens / (N * tokens_per_device)) micro-batches,

    step >= M_min * b1 + max( sum_s a(s) / N,  max_s tmin(s) ).

Memory tightens it: the micro-batch m* holding the longest-running sequence s* holds at most N*cap tokens, so
its area A* is at most K = a(s*) + the fractional-knapsack maximum of sum a(s) over the other sequences within
N*cap - s* tokens. Its makespan is >= b1 + max(tmin(s*), A*/N) and the others together >= (A - A*)/N, hence

    step >= M_min * b1 + max( A/N,  tmin(s*) + (A - min(K, N * tmin(s*))) / N ).

Latency tightens it too (a parametric area bound): a sequence that must finish within tau can only use groups
with t(s, d) <= tau, so its least area grows as tau shrinks, a(s, tau) = min{ d*t(s,d) : t(s,d) <= tau }. Every
sequence of a plan of step time T finishes within tau = T - M_min*b1, so T - M_min*b1 >= sum_s a(s, tau) / N;
the smallest tau with tau >= sum_s a(s, tau)/N (found by bisection: the right side falls as tau grows) gives

    step >= M_min * b1 + tau*.

The reported bound is the larger of the two. It holds for every plan, whatever its micro-batching, so the
reported gap (plan / bound - 1) is an honest over-estimate of the distance to the optimum.
"""

from __future__ import annotations

import math

import numpy as np

from solver.packing import GroupType

__all__ = [
    "area_and_min_time",
    "latency_area_bound_ms",
    "micro_batch_bound_ms",
    "step_bound_ms",
    "min_micro_batches",
]


def area_and_min_time(table: np.ndarray, types: list[GroupType]) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence: least device-time a(s) and least wall time tmin(s) over the types it fits (inf if none)."""
    degrees = np.array([t.degree for t in types], dtype=np.float64)
    return np.min(table * degrees[None, :], axis=1), np.min(table, axis=1)


def min_micro_batches(lengths, num_devices: int, tokens_per_device: int) -> int:
    return max(1, math.ceil(int(np.sum(lengths)) / (num_devices * tokens_per_device)))


def latency_area_bound_ms(table: np.ndarray, degrees: np.ndarray, num_devices: int, iters: int = 40) -> float:
    """Smallest tau with tau >= sum_s a(s, tau) / N (the parametric area bound, without b1)."""
    areas = table * degrees[None, :]
    lo = float(np.min(table, axis=1).max())  # below this some sequence fits no group

    def need(tau: float) -> float:
        return float(np.where(table <= tau, areas, np.inf).min(axis=1).sum()) / num_devices

    if need(lo) <= lo:
        return lo
    hi = max(lo, need(lo))  # at tau = need(lo) areas are no larger than at lo, so need(hi) <= hi
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if need(mid) <= mid:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-4 * hi:
            break
    return hi


def micro_batch_bound_ms(table: np.ndarray, degrees: np.ndarray, num_devices: int, b1_ms: float) -> float:
    """Bound for one micro-batch whose sequences have these rows of the time table."""
    return b1_ms + latency_area_bound_ms(table, degrees, num_devices)


def step_bound_ms(table: np.ndarray, types, lengths, num_devices: int, tokens_per_device: int, b1_ms: float) -> float:
    """Bound for a whole step (any micro-batching): the larger of the memory and the latency bounds."""
    degrees = np.array([t.degree for t in types], dtype=np.float64)
    area, tmin = area_and_min_time(table, types)
    lengths = np.asarray(lengths, dtype=np.float64)
    n = num_devices
    m_min = min_micro_batches(lengths, n, tokens_per_device)
    total = float(area.sum())
    star = int(np.argmax(tmin))
    t_star = float(tmin[star])
    room = n * tokens_per_device - lengths[star]
    others = np.ones(lengths.size, dtype=bool)
    others[star] = False
    density = area[others] / lengths[others]  # device-ms per token
    order = np.argsort(-density, kind="stable")
    toks = lengths[others][order]
    fill = np.clip(room - (np.cumsum(toks) - toks), 0.0, toks)  # tokens of each item that fit (fractional)
    k = float(area[star]) + float((density[order] * fill).sum())
    memory = max(total / n, t_star + (total - min(k, n * t_star)) / n)
    return m_min * b1_ms + max(memory, latency_area_bound_ms(table, degrees, n))
