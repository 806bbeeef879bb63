"""Optimal length buckets (FlexSP §4.1.3): group similar lengths so the MILP has one integer per bucket.

Lengths sorted ascending, each bucket rounds its members up to its largest length; the boundaries minimise the
padded tokens with the 1-D dynamic programme
    err[k][q] = min_j err[j][q-1] + sum_{i=j+1..k} (s_k - s_i)
(FlexSP reports 0.5-2.3 % token error on real corpora against 8.8-22 % for fixed-width buckets).
"""

from __future__ import annotations

import numpy as np

__all__ = ["Bucket", "optimal_buckets", "padding_tokens"]


class Bucket(tuple):
    """(upper length, member indices into the input) - a tuple so it stays a plain value."""

    __slots__ = ()

    def __new__(cls, upper: int, members):
        return super().__new__(cls, (int(upper), tuple(int(m) for m in members)))

    @property
    def upper(self) -> int:
        return self[0]

    @property
    def members(self) -> tuple[int, ...]:
        return self[1]


def optimal_buckets(lengths, max_buckets: int) -> list[Bucket]:
    """Split `lengths` into at most `max_buckets` buckets of consecutive sorted lengths, minimising padding.

    Returns buckets in ascending order of their upper length; members are indices into `lengths`.
    """
    if max_buckets < 1:
        raise ValueError(f"max_buckets must be >= 1, got {max_buckets}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return []
    values, inverse, counts = np.unique(lengths, return_inverse=True, return_counts=True)
    u = values.size
    q = min(max_buckets, u)
    if q == u:  # every distinct length its own bucket: zero padding
        cuts = list(range(1, u + 1))
    else:
        cuts = _dp_cuts(values.astype(np.float64), counts.astype(np.float64), q)
    buckets = []
    start = 0
    for end in cuts:  # bucket holds distinct values [start, end)
        members = np.flatnonzero((inverse >= start) & (inverse < end))
        buckets.append(Bucket(values[end - 1], members))
        start = end
    return buckets


def _dp_cuts(v: np.ndarray, c: np.ndarray, q: int) -> list[int]:
    """The DP's cuts. cost(j, k) (distinct values j..k-1 in one bucket padded to v[k-1]) is a Monge array: for
    a <= b <= c <= d, cost(a, d) + cost(b, c) - cost(a, c) - cost(b, d) = count(a..b-1) * (v[d-1] - v[c-1]) >= 0. So the
    first best previous cut is nondecreasing in k and each layer is solved by divide and conquer (all the midpoints
    of one level at once) in O(u log u) instead of O(u^2): 16 buckets over 8,000 distinct lengths take
    milliseconds, not gigabytes. Costs are integers (exact in float64), so the cuts are those of the full table."""
    u = v.size
    cnt = np.concatenate([[0.0], np.cumsum(c)])  # cnt[k] = sum_{i<k} c_i
    wsum = np.concatenate([[0.0], np.cumsum(c * v)])  # wsum[k] = sum_{i<k} c_i v_i
    top = np.concatenate([[0.0], v])  # top[k] = v[k-1]
    err = np.full(u + 1, np.inf)
    err[0] = 0.0
    back = np.zeros((q + 1, u + 1), dtype=np.int64)
    for qq in range(1, q + 1):
        err, back[qq] = _layer(err, cnt, wsum, top, u, qq)
    cuts = []
    kk = u
    for qq in range(q, 0, -1):
        cuts.append(kk)
        kk = int(back[qq][kk])
        if kk == 0:
            break
    return sorted(cuts)


def _layer(err, cnt, wsum, top, u: int, qq: int) -> tuple[np.ndarray, np.ndarray]:
    """new[k] = min_{j<k} err[j] + cost(j, k) and its first best j, for layer qq (finite for k >= qq only)."""
    new = np.full(u + 1, np.inf)
    back = np.zeros(u + 1, dtype=np.int64)
    if qq > u:
        return new, back
    # open intervals of k (inclusive) with the range of j their best cut lies in
    lo_k, hi_k = np.array([qq]), np.array([u])
    lo_j, hi_j = np.array([qq - 1]), np.array([u - 1])
    while lo_k.size:
        mid = (lo_k + hi_k) // 2
        jh = np.minimum(hi_j, mid - 1)
        lens = jh - lo_j + 1
        seg = np.repeat(np.arange(mid.size), lens)
        j = np.repeat(lo_j - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
        k = mid[seg]
        val = err[j] + ((cnt[k] - cnt[j]) * top[k] - (wsum[k] - wsum[j]))
        starts = np.cumsum(lens) - lens
        best = np.minimum.reduceat(val, starts)
        hit = np.flatnonzero(val == best[seg])
        _, first = np.unique(seg[hit], return_index=True)
        arg = j[hit[first]]
        new[mid], back[mid] = best, arg
        left, right = lo_k <= mid - 1, mid + 1 <= hi_k
        lo_k, hi_k = np.concatenate([lo_k[left], mid[right] + 1]), np.concatenate([mid[left] - 1, hi_k[right]])
        lo_j, hi_j = np.concatenate([lo_j[left], arg[right]]), np.concatenate([arg[left], hi_j[right]])
    return new, back


def padding_tokens(lengths, buckets: list[Bucket]) -> int:
    """Tokens added by rounding every member up to its bucket's upper length."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return int(sum(int((b.upper - lengths[list(b.members)]).sum()) for b in buckets))
