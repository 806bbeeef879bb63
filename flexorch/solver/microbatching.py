"""Candidate micro-batch splits of one step (Sequence Blaster, FlexSP §4.2), shared by planner and baselines.

The splits are ``solver.blaster``'s (FlexSP's sorted min-max split and flexorch's balanced one), computed here in
O(M log K) per feasibility test (prefix sums and binary search instead of a pass over the sequences) and with one
heap over the micro-batches, so that 16,384-sequence batches split in milliseconds; the answers are the same.
"""

from __future__ import annotations

import heapq
import math
import time

import numpy as np

__all__ = ["partition_candidates", "iter_candidates", "sorted_split", "balanced_split"]


def partition_candidates(
    lengths, work, capacity_tokens: int, extra: int = 4, deadline: float | None = None
) -> list[list[list[int]]]:
    """Splits into M = M_min .. M_min + extra micro-batches, a balanced one and FlexSP's sorted one for each.

    A split is kept only when every micro-batch fits `capacity_tokens` (the tokens all N devices hold).
    Duplicates are removed; order is by M then strategy. Past `deadline` (``time.monotonic()``) no further M is
    tried once some split is in hand.
    """
    out, last = [], 0
    for m, split in iter_candidates(lengths, work, capacity_tokens, extra):
        if out and m > last and deadline is not None and time.monotonic() >= deadline:
            break
        out.append(split)
        last = m
    return out


def iter_candidates(lengths, work, capacity_tokens: int, extra: int = 4):
    """(M, split) in the order of :func:`partition_candidates`, computed lazily: a caller that knows no split of M
    or more micro-batches can win stops early."""
    lengths = np.asarray(lengths, dtype=np.int64)
    m_min = max(1, math.ceil(int(lengths.sum()) / capacity_tokens))
    seen = set()
    order_work = np.argsort(-np.asarray(work, dtype=np.float64), kind="stable")
    order_len = np.argsort(-lengths, kind="stable")
    for m in range(m_min, min(m_min + extra, lengths.size) + 1):
        # balanced work with tokens kept near the mean too: a micro-batch filled to the last token of memory
        # leaves the packer no room (only one group of all N devices can hold it)
        even = min(capacity_tokens, max(int(lengths.max()), math.ceil(lengths.sum() / m * 1.08)))
        balanced = balanced_split(lengths, work, m, even, order_work) or balanced_split(
            lengths, work, m, capacity_tokens, order_work
        )
        for split in (balanced, sorted_split(lengths, m, order_len)):
            if split is None or any(int(lengths[c].sum()) > capacity_tokens for c in split):
                continue
            key = tuple(sorted(tuple(sorted(c)) for c in split))
            if key not in seen:
                seen.add(key)
                yield m, split


def sorted_split(lengths, m: int, order=None) -> list[list[int]]:
    """FlexSP's split (``blaster.sorted_chunks``): sort descending, cut into at most m consecutive chunks that
    minimise the largest chunk's tokens (binary search on the bound, greedy check by prefix sums), then split the
    largest chunks until there are min(m, K)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable") if order is None else order
    t = lengths[order]
    k = t.size
    prefix = np.concatenate([[0], np.cumsum(t)])
    lo, hi = int(t.max()), int(t.sum())
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy_ends(prefix, mid, m + 1)) <= m:
            hi = mid
        else:
            lo = mid + 1
    ends = _greedy_ends(prefix, lo, k)
    while len(ends) < min(m, k):  # never raises the maximum
        starts = [0] + ends[:-1]
        sizes = [e - s for s, e in zip(starts, ends, strict=True)]
        i = int(np.argmax(sizes))
        if sizes[i] < 2:
            break
        ends.insert(i, starts[i] + 1)
    out, start = [], 0
    for e in ends:
        out.append(order[start:e].tolist())
        start = e
    return out


def _greedy_ends(prefix: np.ndarray, bound: int, most: int) -> list[int]:
    """Exclusive ends of greedy chunks of sum <= bound (a chunk holds at least one item); stops after `most`."""
    k = prefix.size - 1
    ends, start = [], 0
    while start < k and len(ends) < most:
        e = int(np.searchsorted(prefix, prefix[start] + bound, side="right")) - 1
        e = max(e, start + 1)
        ends.append(e)
        start = e
    if start < k:  # cut short: report one chunk too many
        ends.append(k)
    return ends


def balanced_split(lengths, work, m: int, capacity_tokens: int, order=None) -> list[list[int]] | None:
    """Longest-first into the micro-batch with the least work that still has memory room, ties to the first
    (``blaster.balanced_chunks``); None if a sequence fits none."""
    lengths = np.asarray(lengths, dtype=np.int64)
    work = np.asarray(work, dtype=np.float64)
    order = np.argsort(-work, kind="stable") if order is None else order
    heap = [(0.0, j) for j in range(m)]
    toks = [0] * m
    out: list[list[int]] = [[] for _ in range(m)]
    lens, works = lengths.tolist(), work.tolist()
    for i in order.tolist():
        s = lens[i]
        stash = []
        while heap and toks[heap[0][1]] + s > capacity_tokens:
            stash.append(heapq.heappop(heap))
        if not heap:
            return None
        load, j = heap[0]
        heapq.heapreplace(heap, (load + works[i], j))
        for e in stash:
            heapq.heappush(heap, e)
        out[j].append(i)
        toks[j] += s
    return [c for c in out if c]
