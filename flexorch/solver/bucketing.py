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
    u = v.size
    cnt = np.concatenate([[0.0], np.cumsum(c)])  # cnt[k] = sum_{i<k} c_i
    wsum = np.concatenate([[0.0], np.cumsum(c * v)])  # wsum[k] = sum_{i<k} c_i v_i
    j = np.arange(u + 1)[:, None]
    k = np.arange(u + 1)[None, :]
    # cost[j, k]: distinct values j..k-1 in one bucket padded to v[k-1]  (shape (u+1, u+1))
    top = np.concatenate([[0.0], v])[None, :]  # top[0, k] = v[k-1]
    cost = (cnt[None, :] - cnt[:, None]) * top - (wsum[None, :] - wsum[:, None])
    cost = np.where(j < k, cost, np.inf)
    err = np.full(u + 1, np.inf)
    err[0] = 0.0
    back = np.zeros((q + 1, u + 1), dtype=np.int64)
    for qq in range(1, q + 1):
        total = err[:, None] + cost  # (u+1, u+1): previous cut j, this cut k
        back[qq] = np.argmin(total, axis=0)
        err = total[back[qq], np.arange(u + 1)]
    cuts = []
    kk = u
    for qq in range(q, 0, -1):
        cuts.append(kk)
        kk = int(back[qq][kk])
        if kk == 0:
            break
    return sorted(cuts)


def padding_tokens(lengths, buckets: list[Bucket]) -> int:
    """Tokens added by rounding every member up to its bucket's upper length."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return int(sum(int((b.upper - lengths[list(b.members)]).sum()) for b in buckets))
