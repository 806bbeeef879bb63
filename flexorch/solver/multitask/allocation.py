"""Continuous allocation of devices to MetaOps (Spindle, arXiv 2409.03365, §4.2, Theorem 1).

Spindle relaxes the device count n_m of each MetaOp to a real number and shows that at the optimum all MetaOps
running side by side end together: find C with ``n_m(C) = min{n : L_m * T_m(n) <= C}`` and ``sum_m n_m(C) = N`` by
bisection on C (sum n_m(C) falls as C grows).

**Interpolation between powers of two.** A real n between two valid counts n_a < n_b means: a fraction of the
layers runs on n_a devices and the rest on n_b, and n is the time-averaged device count. Per layer, that mixture
has time tau = (1-f) T(n_a) + f T(n_b) and device-time w = (1-f) W(n_a) + f W(n_b), with W(n) = n T(n), and
n = w / tau (a linear-fractional interpolation in n, linear in the (time, device-time) plane). Counts that are
dominated (a mixture of neighbours is faster for less device-time) are dropped: each MetaOp keeps the lower convex
hull of its points (T(n), W(n)), down to the count of least device-time. Its curve ``g_m(tau)``, the least
device-time per layer at time per layer <= tau, is then convex, piecewise linear and non-increasing.

**Below the cheapest count** c (least device-time, usually 1), Spindle's n >= 1 is replaced by time-sharing: n < c
means running on c for a share n / c of the time, T(n) = W(c) / n. Without it C* would not be a bound: a small
task may run on one device for a moment and hand that device on, which "n >= 1 for the whole C" forbids.

**Chains.** A task's MetaOps run one after another; the task's least device-time within time C is the
infimal convolution of its MetaOps' curves, built by taking their segments steepest first (each curve is convex,
so this keeps each MetaOp's own order). With one MetaOp per task (the usual case) this is exactly Spindle's rule.

**Bound.** C* = min{C : sum_t G_t(C) <= N * C}, G_t the task's least device-time within C. In any schedule on N
devices where every part holds its devices for its whole time, a task's parts do not overlap in time and each part
of l layers of MetaOp m on n devices (a valid count) takes l * T_m(n): the parts of task t fit in the makespan S,
so they use at least G_t(S) device-time (their mixture lies on or above the hull), and all parts together use at
most N * S. Hence sum_t G_t(S) <= N * S, so S >= C*. At C*, sum_t n_t = N with n_t = G_t(C*) / C* (the
task's time-averaged devices) unless one task's fastest time alone sets C*.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from flexorch.solver.errors import PlanningError
from flexorch.solver.multitask.metaop import MetaOp

__all__ = ["Hull", "hull", "Share", "Allocation", "continuous_allocation", "layer_ms_at", "devices_for_time"]


@dataclass(frozen=True)
class Hull:
    """One MetaOp's undominated counts, fastest first: per layer, time rises and device-time falls."""

    counts: tuple[int, ...]
    tau: tuple[float, ...]
    work: tuple[float, ...]


@lru_cache(maxsize=4096)
def hull(m: MetaOp) -> Hull:
    """Lower convex hull of (T(n), n T(n)) over the counts that can run m, cut at the least device-time."""
    pts = sorted((t, c * t, c) for c, t in zip(m.counts, m.layer_ms, strict=True) if math.isfinite(t))
    h: list[tuple[float, float, int]] = []
    for p in pts:
        if h and p[0] == h[-1][0]:
            continue  # same time, more device-time (sorted): dominated
        while len(h) >= 2:
            (x1, y1, _), (x2, y2, _) = h[-2], h[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) <= 0:
                h.pop()  # h[-1] lies on or above the chord h[-2] -> p
            else:
                break
        h.append(p)
    last = int(np.argmin([w for _, w, _ in h]))
    h = h[: last + 1]
    return Hull(tuple(c for _, _, c in h), tuple(t for t, _, _ in h), tuple(w for _, w, _ in h))


def layer_ms_at(m: MetaOp, n: float) -> float:
    """T_m(n) for a real 0 < n <= m's fastest count (the interpolation above); below its least-device-time count
    c, n means time-sharing c (running on c for a share n / c of the time): T(n) = W(c) / n."""
    h = hull(m)
    if not 0 < n <= h.counts[0]:
        raise PlanningError(f"{m.name}: n={n} is outside (0, {h.counts[0]}]")
    if n <= h.counts[-1]:
        return h.work[-1] / n
    for j in range(len(h.counts) - 1):
        if h.counts[j + 1] <= n <= h.counts[j]:
            ta, wa, tb, wb = h.tau[j + 1], h.work[j + 1], h.tau[j], h.work[j]
            # n (tau_a + f (tau_b - tau_a)) = w_a + f (w_b - w_a), f = share of layers on the larger count
            f = (wa - n * ta) / (n * (tb - ta) - (wb - wa))
            return ta + f * (tb - ta)
    return h.tau[0]


def devices_for_time(m: MetaOp, time_ms: float) -> float:
    """n_m(C): the least real n > 0 with L_m * T_m(n) <= C (``layer_ms_at``); inf when none."""
    h = hull(m)
    tau = time_ms / m.layers
    if tau < h.tau[0] * (1 - 1e-12):
        return math.inf
    return float(np.interp(tau, h.tau, h.work) / tau)  # below the least-device-time count: time-sharing it


@dataclass(frozen=True)
class Share:
    """One MetaOp's continuous allocation and its two neighbouring valid counts (Spindle's bi-point)."""

    task: int
    level: int
    time_ms: float
    """L_m * T_m(n*): how long it runs (a task done before C on its cheapest counts is stretched to C)."""
    devices: float
    """n*: its device-time over its time (time-averaged devices; below n_lo when it time-shares its cheapest)."""
    n_lo: int
    n_hi: int
    lo_fraction: float
    """Share of its layers on n_lo in the mixture (the rest on n_hi)."""


@dataclass(frozen=True)
class Allocation:
    makespan_ms: float
    """C (C* when not given): every task ends by it; at C* the proven lower bound."""
    num_devices: int
    shares: tuple[Share, ...]
    task_devices: tuple[float, ...]
    """n_t = G_t(C) / C per task: sums to N at C* unless one task's fastest time sets C*."""


def _task_curves(metaops):
    """Per task: start time, start device-time, segments (dt, dw, metaop index, hull position) steepest first."""
    by_task: dict[int, list[int]] = {}
    for i, m in enumerate(metaops):
        by_task.setdefault(m.task, []).append(i)
    curves = []
    for t in sorted(by_task):
        t0 = w0 = 0.0
        segs = []
        for i in by_task[t]:
            m, h = metaops[i], hull(metaops[i])
            t0, w0 = t0 + m.layers * h.tau[0], w0 + m.layers * h.work[0]
            for j in range(len(h.counts) - 1):
                dt, dw = m.layers * (h.tau[j + 1] - h.tau[j]), m.layers * (h.work[j + 1] - h.work[j])
                segs.append((dw / dt, dt, dw, i, j))
        segs.sort(key=lambda s: s[0])
        times = np.cumsum([t0] + [s[1] for s in segs])
        works = np.cumsum([w0] + [s[2] for s in segs])
        curves.append((t, times, works, segs))
    return curves


def continuous_allocation(metaops, num_devices: int, makespan_ms: float | None = None) -> Allocation:
    """Bisection on C for min{C : sum_t G_t(C) <= N C} (or the allocation at a given C >= that)."""
    metaops = tuple(metaops)
    curves = _task_curves(metaops)

    def area(c: float) -> float:  # sum_t G_t(C)
        return sum(np.interp(c, ts, ws) if c >= ts[0] else math.inf for _, ts, ws, _ in curves)

    lo = max(ts[0] for _, ts, _, _ in curves)
    if area(lo) <= num_devices * lo:
        c_star = lo  # one task's fastest time alone sets C*
    else:
        hi = 2.0 * lo
        while area(hi) > num_devices * hi:
            lo, hi = hi, 2.0 * hi
        while hi - lo > 1e-12 * hi:
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if area(mid) <= num_devices * mid else (mid, hi)
        c_star = hi
    c = c_star if makespan_ms is None else max(c_star, float(makespan_ms))
    return Allocation(
        c, num_devices, _shares(metaops, curves, c), tuple(np.interp(c, ts, ws) / c for _, ts, ws, _ in curves)
    )


def _shares(metaops, curves, c: float) -> tuple[Share, ...]:
    pos = {i: 0.0 for i in range(len(metaops))}  # hull position: vertex j + fraction towards j + 1
    for _, ts, _, segs in curves:
        budget = c - ts[0]
        for _, dt, _, i, j in segs:
            if budget <= 0:
                break
            take = min(1.0, budget / dt)
            budget -= dt
            pos[i] = j + take
    out, raw = [], []
    for i, m in enumerate(metaops):
        h = hull(m)
        j = min(int(pos[i]), len(h.counts) - 1)
        f = pos[i] - j
        if j == len(h.counts) - 1:
            n_hi = n_lo = h.counts[j]
            tau, work = h.tau[j], h.work[j]
        else:
            n_hi, n_lo = h.counts[j], h.counts[j + 1]
            tau = h.tau[j] + f * (h.tau[j + 1] - h.tau[j])
            work = h.work[j] + f * (h.work[j + 1] - h.work[j])
        raw.append((m, m.layers * tau, m.layers * work, n_lo, n_hi, f))
    task_ms: dict[int, float] = {}
    for m, time_ms, *_ in raw:
        task_ms[m.task] = task_ms.get(m.task, 0.0) + time_ms
    for m, time_ms, work, n_lo, n_hi, f in raw:
        # a task done before C sits on its cheapest counts: stretched to C, it time-shares them (n* below them)
        time_ms *= max(1.0, c / task_ms[m.task])
        out.append(Share(m.task, m.level, time_ms, work / time_ms, n_lo, n_hi, f))
    return tuple(out)
