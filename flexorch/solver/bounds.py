"""Proven lower bounds on a step's (or a micro-batch's) makespan under the cost model.

Fixed costs. A group of type t pays O_t = b1 + latency(t) once per micro-batch (`solver.cost_model`; the latency
term is flexorch's extension of FlexSP §4.1.2). Let O = min_t O_t (b1: single devices have no collectives) and
e_t = O_t - O >= 0 the extra fixed cost of type t. A group of type t with load L (its sequences' times) lasts
O + e_t + L, so a micro-batch lasts X = O + max_g (e_g + L_g): every bound below is O per micro-batch plus a
bound on that maximum. The extra e_t counts in the wall time of each sequence on type t, t'(s, t) = t(s, t) + e_t
(its group lasts at least that). A group pays it once, not once per sequence, so in the area it is charged to the
group's sequences in shares that add up to at most d*e_t: by tokens, s*e_t/cap each (a group holds <= d*cap
tokens), or by time, d*t(s, t)*e_t/(tau - e_t) each when the group's load is at most tau - e_t.

Area (LP-relaxation) bound. Let a(s) = min over feasible types of d * t(s, t) + s * e_t / cap: the least
device-time sequence s can cost, and tmin(s) = min_t t'(s, t) the least wall time it can take beyond O. In any
plan, a micro-batch m lasts at least O + max_g (e_g + L_g), and max_g (e_g + L_g) >= (sum_g d_g (e_g + L_g)) / N
>= (sum_{s in m} a(s)) / N, and also >= tmin(s) for every s in m. Summing over micro-batches, and since memory forces
at least M_min = ceil(total tokens / (N * tokens_per_device)) micro-batches,

    step >= M_min * O + max( sum_s a(s) / N,  max_s tmin(s) ).

Memory tightens it: the micro-batch m* holding the longest-running sequence s* holds at most N*cap tokens, so
its area A* is at most K = a(s*) + the fractional-knapsack maximum of sum a(s) over the other sequences within
N*cap - s* tokens. Its makespan is >= O + max(tmin(s*), A*/N) and the others together >= (A - A*)/N, hence

    step >= M_min * O + max( A/N,  tmin(s*) + (A - min(K, N * tmin(s*))) / N ).

Latency tightens it too (a parametric area bound): a sequence that must finish within tau can only use types
with t'(s, t) <= tau, so its least area grows as tau shrinks, a(s, tau) = min{ d*t(s,t) * tau/(tau - e_t) :
t'(s,t) <= tau } (the time share of e_t: a group with load L <= tau - e_t covers d*(e_t + L) >= d*L*tau/(tau - e_t)).
Every sequence of a plan of step time T finishes within tau = T - M_min*O, and the micro-batches' X - O add up to
at most tau, so T - M_min*O >= sum_s a(s, tau) / N;
the smallest tau with tau >= sum_s a(s, tau)/N (found by bisection: the right side falls as tau grows) gives

    step >= M_min * O + tau*.

The other micro-batches hold what the slowest one cannot (split bound). Let X be the largest micro-batch's
X - O. Every sequence finishes within X, so the areas are at least sum_s a(s, X), and the other micro-batches hold
at least L = (total tokens - N*cap) tokens (the slowest holds at most N*cap), whose least area is at least R, the
fractional-knapsack minimum of sum a(s) over sequences holding L tokens (cheapest device-time per token first). The
other micro-batches last at least R/N together, so T - M_min*O >= X + R/N and >= sum_s a(s, X)/N; the first grows
with X and the second falls, so

    step >= M_min * O + R/N + X*,   X* the smallest X with X + R/N >= sum_s a(s, X)/N.

With R = 0 (everything fits one micro-batch) this is the latency bound. It is what a step of two or more
micro-batches pays for their count: each of them is shorter than the step, so a long sequence may need a faster,
costlier group than the latency bound (which lets it take the whole step) allows.

Slow sequences that need many devices (tall bound). Let w(s) = min_t t(s, t), the least time of s on any
group (without the fixed costs), and n(s) the least degree of a group that holds it. Take a threshold tau and the
sequences H with w >= tau. A group of a micro-batch lasting X < j*tau runs fewer than j of them one after another,
and its degree is at least the n(s) of each, so the micro-batches with X >= tau ("tall"; every H sequence is in
one) give H at most N*floor(X/tau) devices each: sum over tall micro-batches of floor(X/tau) >= k = ceil(sum_H n(s)
/ N), hence S = sum_tall X >= tau*k, and there are at most S/tau tall micro-batches, holding at most S/tau * N*cap
tokens. The others hold the rest, at least L - S*N*cap/tau tokens of sequences not in H, whose least area is at
least R(L - S*N*cap/tau) (the fractional knapsack above, over the sequences not in H). So

    step >= M_min * O + min over S >= tau*k of ( S + R(L - S*N*cap/tau) / N )

(convex in S: evaluated at tau*k and at R's breakpoints), for every tau; the bound takes the best tau among the
slowest sequences. It binds where a few sequences need a large share of the devices each and run far longer than a
micro-batch's share of the work (FlexSP's 64-device groups over slow links), which the other bounds spread thin.

The rounds bound and the absorption bound (``solver.round_bounds``) place the slowest sequences exactly into
micro-batches and groups, each chain on a degree that holds it with its time there, and charge the idle
time they leave that the rest cannot use. A plan with more micro-batches than the fewest pays their fixed cost, and
one with the fewest may have to run short sequences on the slowest ones' large groups (``solver.count_bounds``).

The reported bound is the largest of the six, raised by the count bound. It holds for every plan, whatever its
micro-batching, so the reported gap (plan / bound - 1) is an honest over-estimate of the distance to the optimum.
"""

from __future__ import annotations

import math

import numpy as np

from flexorch.solver.count_bounds import count_bound_ms
from flexorch.solver.packing import GroupType
from flexorch.solver.round_bounds import absorb_bound_ms, rounds_bound_ms, slowest_fronts

__all__ = [
    "area_and_min_time",
    "latency_area_bound_ms",
    "tall_bound_ms",
    "micro_batch_bound_ms",
    "step_bound_ms",
    "min_micro_batches",
]


def _extra(overheads, nt: int) -> np.ndarray:
    """e_t = O_t - min O: each type's fixed cost above the cheapest type's (zeros when `overheads` is None)."""
    if overheads is None:
        return np.zeros(nt)
    o = np.asarray(overheads, dtype=np.float64)
    return o - o.min()


def area_and_min_time(
    table: np.ndarray,
    types: list[GroupType],
    overheads: np.ndarray | None = None,
    lengths=None,
    tokens_per_device: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence: least device-time a(s) and least wall time tmin(s) over the types it fits (inf if none).

    With `overheads` (per type), tmin includes each type's fixed cost above the cheapest type's, and with `lengths`
    and `tokens_per_device` too, a(s) includes its token share of that extra cost (see above).
    """
    degrees = np.array([t.degree for t in types], dtype=np.float64)
    extra = _extra(overheads, len(types))
    areas = table * degrees[None, :]
    if lengths is not None and tokens_per_device is not None:
        areas = areas + np.asarray(lengths, dtype=np.float64)[:, None] * extra[None, :] / tokens_per_device
    return np.min(areas, axis=1), np.min(table + extra[None, :], axis=1)


def min_micro_batches(lengths, num_devices: int, tokens_per_device: int) -> int:
    return max(1, math.ceil(int(np.sum(lengths)) / (num_devices * tokens_per_device)))


def latency_area_bound_ms(
    table: np.ndarray,
    degrees: np.ndarray,
    num_devices: int,
    extra: np.ndarray | None = None,
    iters: int = 60,
    rest_ms: float = 0.0,
) -> float:
    """Smallest tau with tau >= sum_s a(s, tau) / N (the parametric area bound, without the base overhead O).

    `extra[t]` is type t's fixed cost above the cheapest type's: it counts in a sequence's wall time on t, and in
    its area as the time share d*t*e_t/(tau - e_t). With `rest_ms` (R/N of the split bound): rest_ms + the smallest
    X with X + rest_ms >= sum_s a(s, X) / N.
    """
    areas = table * degrees[None, :]
    e = np.zeros(table.shape[1]) if extra is None else np.asarray(extra, dtype=np.float64)
    wall = table + e[None, :]
    lo = float(np.min(wall, axis=1).max())  # below this some sequence fits no group

    def need(tau: float) -> float:
        room = tau - e
        scale = np.divide(tau, room, out=np.ones_like(room), where=room > 0)  # tau/(tau - e_t); 1 where no room
        return float(np.where(wall <= tau, areas * scale[None, :], np.inf).min(axis=1).sum()) / num_devices

    r = float(rest_ms)
    if need(lo) <= lo + r:
        return lo + r
    hi = max(lo, need(lo))  # at tau = need(lo) areas are no larger than at lo, so need(hi) <= hi (+ r)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if need(mid) <= mid + r:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-6 * hi:
            break
    # need(lo) > lo + r, and need falls as tau grows, so every tau <= lo is infeasible: tau* > lo (hi may exceed it)
    return lo + r


def micro_batch_bound_ms(table: np.ndarray, degrees: np.ndarray, num_devices: int, overheads: np.ndarray) -> float:
    """Bound for one micro-batch whose sequences have these rows of the time table (`overheads[t]`: O_t)."""
    o = np.asarray(overheads, dtype=np.float64)
    return float(o.min()) + latency_area_bound_ms(table, degrees, num_devices, o - o.min())


def step_bound_ms(
    table: np.ndarray,
    types,
    lengths,
    num_devices: int,
    tokens_per_device: int,
    overheads: np.ndarray,
    split: bool = True,
    slowest=None,
) -> float:
    """Bound for a whole step (any micro-batching): the largest of the memory, the latency and (with `split`, the
    default) the split bound.

    `overheads[t]` is the fixed cost O_t of a group of type t per micro-batch (`solver.packing.type_overheads`).
    """
    degrees = np.array([t.degree for t in types], dtype=np.float64)
    o = np.asarray(overheads, dtype=np.float64)
    base, extra = float(o.min()), o - o.min()
    area, tmin = area_and_min_time(table, types, o, lengths, tokens_per_device)
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
    bound = max(memory, latency_area_bound_ms(table, degrees, n, extra))
    rest_tokens = float(lengths.sum()) - n * tokens_per_device  # what the slowest micro-batch cannot hold
    if split and rest_tokens > 0:
        per_token = area / np.maximum(lengths, 1.0)
        cheap = np.argsort(per_token, kind="stable")
        toks = lengths[cheap]
        take = np.clip(rest_tokens - (np.cumsum(toks) - toks), 0.0, toks)  # cheapest device-time per token first
        rest = float((per_token[cheap] * take).sum())
        bound = max(bound, latency_area_bound_ms(table, degrees, n, extra, rest_ms=rest / n))
    if split:
        if slowest is None:  # the planner passes them: it starts splits from them too
            slowest = slowest_fronts(table, degrees, lengths, n, tokens_per_device)
        bound = max(bound, tall_bound_ms(table, degrees, lengths, area, n, tokens_per_device, slowest=slowest))
        bound = max(bound, absorb_bound_ms(table, degrees, lengths, n, tokens_per_device, slowest=slowest))
        # one micro-batch more pays one O more; the fewest pay where the slowest leave no room (solver.count_bounds)
        return count_bound_ms(table, degrees, lengths, n, tokens_per_device, m_min, base, m_min * base + bound, slowest)
    return m_min * base + bound


def tall_bound_ms(
    table: np.ndarray,
    degrees,
    lengths,
    area: np.ndarray,
    num_devices: int,
    tokens_per_device: int,
    most: int = 128,
    slowest=None,
) -> float:
    """The tall bound (module docstring), without M_min * O, over thresholds tau at the `most` slowest sequences.

    ``area[s]``: each sequence's least device-time (``area_and_min_time`` with the token share of fixed costs)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    finite = np.isfinite(table)
    w = np.where(finite, table, np.inf).min(axis=1)
    need = np.asarray(degrees, dtype=np.float64)[np.argmax(finite, axis=1)]  # least degree that holds each
    n, cap = num_devices, tokens_per_device
    slow = np.argsort(-w, kind="stable")
    few, fronts = slowest if slowest is not None else slowest_fronts(table, degrees, lengths, n, cap)
    rounds = rounds_bound_ms(fronts, few.size)
    cheap = np.argsort(area / np.maximum(lengths, 1.0), kind="stable")  # least device-time per token first
    toks_all, area_all = lengths[cheap], area[cheap]
    rank = np.empty(lengths.size, dtype=np.int64)
    rank[slow] = np.arange(lengths.size)
    total = float(lengths.sum())
    best = 0.0
    for j in range(min(most, lengths.size)):
        tau = float(w[slow[j]])
        if not tau > 0:
            break
        k = math.ceil(float(need[slow[: j + 1]].sum()) / n - 1e-9)
        light = rank[cheap] > j  # not in H, in cheapest-per-token order
        toks, ar = toks_all[light], area_all[light]
        cum = np.concatenate([[0.0], np.cumsum(toks)])  # R's breakpoints (tokens) and its values there
        val = np.concatenate([[0.0], np.cumsum(ar)])
        s_min = tau * k  # S >= tau * k, and >= S_j of the rounds bound (for the K slowest once H holds them)
        if rounds:
            s_min = max(s_min, rounds[min(j, len(rounds) - 1)])
        x0 = total - s_min * n * cap / tau  # tokens the short micro-batches hold at least when S = s_min
        xs = np.concatenate([[max(0.0, x0)], cum[cum < x0]])  # S at least s_min: x at most x0
        rs = np.interp(xs, cum, val, right=np.inf)  # R(x): inf where the light sequences cannot hold x tokens
        f = tau * (total - xs) / (n * cap) + rs / n  # S + R(x)/N with S = tau * (L - x) / (N * cap)
        f = np.maximum(f, s_min)
        best = max(best, float(f.min()))
    return best
