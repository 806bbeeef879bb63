"""Sequence Blaster (FlexSP §4.2): split a step's batch into micro-batches when it exceeds the cluster's memory.

FlexSP sorts the sequences by length and cuts them into M consecutive chunks that minimise the largest chunk's
tokens (a min-max linear-partition DP), for M from ceil(tokens / capacity) to +4, plans each and keeps the M with
the smallest summed makespan. flexorch also tries a balanced split (longest-first into the micro-batch with the
least work) and keeps whichever plans faster; both are candidates, the planner decides.
"""

from __future__ import annotations

import numpy as np

__all__ = ["min_max_partition", "sorted_chunks", "balanced_chunks"]


def min_max_partition(tokens, m: int) -> list[int]:
    """Cut `tokens` (in the given order) into at most m consecutive non-empty chunks minimising the largest sum.

    Returns the exclusive end index of each chunk. Exact: binary search on the bound with a greedy feasibility
    check (for a fixed bound, greedy filling uses the fewest chunks), the classic linear-partition argument.
    """
    t = np.asarray(tokens, dtype=np.int64)
    k = t.size
    if k == 0:
        return []
    if m < 1:
        raise ValueError(f"need at least one chunk, got m={m}")
    lo, hi = int(t.max()), int(t.sum())
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy_ends(t, mid)) <= m:
            hi = mid
        else:
            lo = mid + 1
    ends = _greedy_ends(t, lo)
    # use exactly min(m, k) chunks when possible: split the largest chunks further (never raises the maximum)
    while len(ends) < min(m, k):
        starts = [0] + ends[:-1]
        sizes = [e - s for s, e in zip(starts, ends, strict=True)]
        i = int(np.argmax(sizes))
        if sizes[i] < 2:
            break
        ends.insert(i, starts[i] + 1)
    return ends


def _greedy_ends(t: np.ndarray, bound: int) -> list[int]:
    ends = []
    acc = 0
    for i, x in enumerate(t.tolist()):
        if acc + x > bound and acc > 0:
            ends.append(i)
            acc = 0
        acc += x
    ends.append(t.size)
    return ends


def sorted_chunks(lengths, m: int) -> list[list[int]]:
    """FlexSP's split: sort descending, min-max-token consecutive chunks. Returns index lists into lengths."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    ends = min_max_partition(lengths[order], m)
    out, start = [], 0
    for e in ends:
        out.append(order[start:e].tolist())
        start = e
    return out


def balanced_chunks(lengths, work, m: int, capacity_tokens: int) -> list[list[int]] | None:
    """Longest-first into the micro-batch with the least work that still has memory room (None if one does not fit)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    work = np.asarray(work, dtype=np.float64)
    order = np.argsort(-work, kind="stable")
    load = np.zeros(m)
    toks = np.zeros(m, dtype=np.int64)
    out: list[list[int]] = [[] for _ in range(m)]
    for i in order.tolist():
        room = toks + lengths[i] <= capacity_tokens
        if not room.any():
            return None
        j = int(np.argmin(np.where(room, load, np.inf)))
        out[j].append(i)
        load[j] += work[i]
        toks[j] += lengths[i]
    return [c for c in out if c]
