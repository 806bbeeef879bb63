"""What the fewest micro-batches cost when the slowest sequences fill their devices, for ``solver.bounds``.

Every bound of ``solver.bounds`` is M_min * O plus a bound W on the rest of the step that holds for any number of
micro-batches M (O: the least fixed cost a micro-batch pays, M_min: the fewest micro-batches memory allows). A plan
with more than M_min micro-batches pays one O more, so the step is at least

    min( M_min * O + W + O,  the least step time of plans with exactly M_min micro-batches ).

A plan with exactly M_min micro-batches has little memory to spare, and where the slowest sequence runs fastest on
most of the devices its micro-batch ("round") leaves the others little room: the M_min - r micro-batches without
any of the slowest sequences H (the j = 1..3 slowest) hold at most (M_min - r)*N*cap tokens of the other ("light")
sequences, a round's devices outside its chains' groups at most (N - u)*cap, so at least

    F = light tokens - (M_min - r)*N*cap - sum over rounds of (N - u)*cap

light tokens run on the chains' groups, whose degree is at least d_H, the least degree that holds a sequence of H.
There a light sequence costs at least its least device-time on a group of degree >= d_H, more than its least
device-time a'(s) by Delta(s); the least extra over F tokens, D(F), is a fractional knapsack (least Delta per token
first). Charging every light sequence a'(s), plus Delta(s) where it runs on a chain's group, the charges add up to at
least A + D(F) (A: the light sequences' a'(s)); a round of length X whose chains take u devices and are busy
B >= sum n(s)*w(s), sum a'(s) of their sequences can take at most min((N - u)*X, G((N - u)*cap)) of charge on its
free devices (G: the most a'(s) that much memory holds, densest first) and u*X - B on its chains' groups, and the
other micro-batches run the rest at most N at a time. With X the round's longest chain (its length is at least
that, and a longer round takes at most N more charge per unit of time, so X is the worst case), for every partition
of H into r <= M_min rounds and every point (u, X) of each round's front (``solver.round_bounds.round_fronts``, each
chain on the degree it runs on):

    step - M_min*O >= sum over rounds of X + (A + D(F) - sum over rounds of (min((N-u)X, G) + u*X - B)) / N.

It binds where one sequence runs fastest on all N devices and the rest do not fit the other micro-batches (FlexSP's
GPT-7B setting: a 118K-token sequence on 64 devices, 517K tokens of short ones for one more micro-batch of 400K: the
plan runs three micro-batches, and the bound without it counted two O).
"""

from __future__ import annotations

import numpy as np

__all__ = ["count_bound_ms", "COUNT_K"]

COUNT_K = 3
"""The slowest sequences the count bound places into rounds (every partition, every front point)."""


def count_bound_ms(
    table: np.ndarray,
    degrees,
    lengths,
    num_devices: int,
    tokens_per_device: int,
    m_min: int,
    base_ms: float,
    any_ms: float,
    slowest,
) -> float:
    """The step bound ``any_ms`` (``solver.bounds.step_bound_ms`` before this one, M_min * O included) raised to
    min(``any_ms`` + O, the bound for exactly M_min micro-batches) (module docstring); ``base_ms``: O,
    ``slowest``: the slowest sequences and their per-degree fronts (``solver.round_bounds.slowest_fronts``)."""
    few, fronts = slowest
    if few.size == 0:
        return any_ms
    lengths = np.asarray(lengths, dtype=np.float64)
    degrees = np.asarray(degrees, dtype=np.float64)
    n, cap = num_devices, tokens_per_device
    finite = np.isfinite(table)
    dev_time = np.where(finite, table * degrees[None, :], np.inf)
    pure = dev_time.min(axis=1)  # a'(s)
    w = np.where(finite, table, np.inf).min(axis=1)
    need = degrees[np.argmax(finite, axis=1)]  # n(s): the least degree that holds s
    busy = np.maximum(need * w, pure)  # a sequence's device-time on its chain's group, at least
    exact = base_ms * m_min
    best = 0.0
    per_seq = (pure, need, busy, dev_time, degrees)
    for j in range(1, min(COUNT_K, few.size) + 1):
        got = _slowest_j_bound(j, few, fronts, per_seq, lengths, n, cap, m_min)
        if np.isfinite(got):
            best = max(best, got)
    return max(any_ms, min(any_ms + base_ms, exact + best))


def _slowest_j_bound(j: int, few, fronts, per_seq: tuple, lengths, n: int, cap: int, m_min: int) -> float:
    """The bound for exactly M_min micro-batches with the `j` slowest sequences in rounds of their own, the rest
    (the light sequences) around them; the least over the partitions of the j into rounds (inf: none)."""
    pure, need, busy, dev_time, degrees = per_seq
    h = few[:j].tolist()
    light = np.ones(lengths.size, dtype=bool)
    light[h] = False
    if not light.any():
        return np.inf
    area = float(pure[light].sum())
    light_tokens = float(lengths[light].sum())
    d_h = float(need[h].min())
    extra = np.where(degrees[None, :] >= d_h, dev_time, np.inf).min(axis=1)[light] - pure[light]  # Delta(s)
    cheap = np.argsort(extra / np.maximum(lengths[light], 1.0), kind="stable")
    cum_toks = np.concatenate([[0.0], np.cumsum(lengths[light][cheap])])
    cum_extra = np.concatenate([[0.0], np.cumsum(extra[cheap])])
    dense = np.argsort(-pure[light] / np.maximum(lengths[light], 1.0), kind="stable")
    g_toks = np.concatenate([[0.0], np.cumsum(lengths[light][dense])])
    g_area = np.concatenate([[0.0], np.cumsum(pure[light][dense])])
    g_free = np.interp(np.arange(n + 1, dtype=np.float64) * cap, g_toks, g_area)  # G(f * cap), f = 0..N
    light_parts = (area, light_tokens, cum_toks, cum_extra, g_free)
    got = np.inf
    for part in _partitions(list(range(j))):
        if len(part) > m_min:
            continue
        got = min(got, _partition_bound(part, few, fronts, busy, light_parts, n, cap, m_min))
    return got


def _partition_bound(part, few, fronts, busy, light_parts: tuple, n: int, cap: int, m_min: int) -> float:
    """The bound of one partition of the slowest sequences into rounds: the least over every combination of one
    point of each round's front (inf when a round has no front)."""
    area, light_tokens, cum_toks, cum_extra, g_free = light_parts
    rounds = []
    for members in part:
        pts = np.array(fronts[sum(1 << i for i in members)], dtype=np.float64).reshape(-1, 2)
        if pts.size == 0:
            return np.inf
        u, x = pts[:, 0], pts[:, 1]  # each point of the round's front: devices its chains take, length
        free = n - u
        load = busy[few[members]].sum()
        absorbed = np.minimum(free * x, g_free[free.astype(np.int64)]) + u * x - load
        rounds.append((x, x - absorbed / n, free))
    # every combination of one point per round
    length = _mesh_sum([r[0] for r in rounds])
    cost = _mesh_sum([r[1] for r in rounds])
    free = _mesh_sum([r[2] for r in rounds])
    forced = light_tokens - (m_min - len(part)) * n * cap - free * cap
    d = np.interp(np.maximum(forced, 0.0), cum_toks, cum_extra, right=np.inf)
    return float(np.min(np.maximum(length, cost + (area + d) / n)))


def _partitions(items: list[int]):
    """Every partition of ``items`` into non-empty blocks."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield part[:i] + [[first, *part[i]]] + part[i + 1 :]


def _mesh_sum(arrays: list[np.ndarray]) -> np.ndarray:
    """Every sum of one entry of each array (an open grid, one axis per array)."""
    out = np.zeros(())
    for i, a in enumerate(arrays):
        out = out + a.reshape((1,) * i + (-1,) + (1,) * (len(arrays) - 1 - i))
    return out
