"""Candidate micro-batch splits of one step (Sequence Blaster, FlexSP §4.2), shared by planner and baselines.

The splits are FlexSP's sorted min-max split (:func:`sorted_split`) and flexorch's balanced one
(:func:`balanced_split`), computed in O(M log K) per feasibility test (prefix sums and binary search instead of a pass
over the sequences) and with one heap over the micro-batches, so that batches of many thousands of sequences split in
milliseconds.

With the sequences' least wall times and group sizes the planner adds a third kind, the tiered split
(:func:`tiered_split`): the step's time is the *sum* of its micro-batches' makespans, and a micro-batch lasts at
least as long as its slowest sequence, so sequences far slower than an average micro-batch are put together (as
many as the devices hold side by side) instead of being spread one per micro-batch, where each would set that
micro-batch's makespan. The balanced split spreads them; the sorted split groups them but fills their micro-batch
with the next-longest sequences up to the memory, which then find no devices left.
"""

from __future__ import annotations

import heapq
import math
import time

import numpy as np

__all__ = ["partition_candidates", "iter_candidates", "sorted_split", "balanced_split", "tiered_split"]

TIER_RATIO = 2.0
"""A sequence is put with its own tier when its least wall time is over this many times the average micro-batch's
share of the work (``tiered_split``)."""
TIER_RATIOS = (TIER_RATIO, 1.0)
"""The planner's tiered candidates: one ratio alone misses the best tiering on some steps of long-tailed lengths
(``benchmarks/sim/planner_quality.py``'s code256; the figures are in docs/benchmarks.md)."""


def partition_candidates(
    lengths, work, capacity_tokens: int, extra: int = 4, deadline: float | None = None, tiers=None, kinds=None
) -> list[list[list[int]]]:
    """Splits into M = M_min .. M_min + extra micro-batches, a balanced one and FlexSP's sorted one for each, and
    with `tiers` = (wall, min_devices, num_devices[, own[, rounds[, halves]]]) tiered ones for each
    (:func:`tiered_split`), first; with ``rounds`` (the seeds of ``tiered_split``) also tiered ones that start from
    those micro-batches; with ``halves`` = (devices, seeds) of the slowest sequences as they run (``solver.halves``)
    also tiered ones from those, and at the fewest micro-batches each tiered split again with its tiered
    micro-batches taking the shortest of the rest where the rest would need one more (``squeeze``).

    A split is kept only when every micro-batch fits `capacity_tokens` (the tokens all N devices hold).
    Duplicates are removed; order is by M then strategy. Past `deadline` (``time.monotonic()``) no further M is
    tried once some split is in hand. `kinds`, a list, gets each split's strategy ('tiered-<ratio>',
    'rounds-<ratio>', 'halves-<ratio>', each maybe with '-squeezed', 'balanced', 'sorted') appended.
    """
    out, last = [], 0
    for m, kind, split in _candidates(lengths, work, capacity_tokens, extra, tiers):
        if out and m > last and deadline is not None and time.monotonic() >= deadline:
            break
        out.append(split)
        if kinds is not None:
            kinds.append(kind)
        last = m
    return out


def iter_candidates(lengths, work, capacity_tokens: int, extra: int = 4, tiers=None):
    """(M, split) in the order of :func:`partition_candidates`, computed lazily: a caller that knows no split of M
    or more micro-batches can win stops early."""
    for m, _, split in _candidates(lengths, work, capacity_tokens, extra, tiers):
        yield m, split


def _candidates(lengths, work, capacity_tokens: int, extra: int = 4, tiers=None):
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
        named = []
        if tiers is not None:
            wall, need, num_devices, *more = tiers
            own = more[0] if more else None
            rounds = more[1] if len(more) > 1 else None
            halves = more[2] if len(more) > 2 else None  # (devices, seeds) of the slowest as they run
            variants = [("tiered", need, None, TIER_RATIOS)]
            if rounds:
                variants.append(("rounds", need, rounds, (TIER_RATIO,)))  # one more candidate, not two
            if halves is not None:
                variants.append(("halves", halves[0], halves[1], TIER_RATIOS))
            for name, devices, seeds, ratios in variants:
                for ratio in ratios:
                    for squeeze in (False, True) if halves is not None and m == m_min else (False,):
                        kw = dict(capacity_tokens=capacity_tokens, extra=m - m_min, own=own, ratio=ratio)
                        args = (lengths, work, wall, devices, num_devices)
                        split = tiered_split(*args, seeds=seeds, squeeze=squeeze, **kw)
                        if split is None and seeds and name == "halves":  # this ratio tiers none of the seeds
                            split = tiered_split(*args, squeeze=squeeze, **kw)
                        named.append((f"{name}-{ratio:g}{'-squeezed' if squeeze else ''}", split))
        for kind, split in (*named, ("balanced", balanced), ("sorted", sorted_split(lengths, m, order_len))):
            if split is None or any(int(lengths[c].sum()) > capacity_tokens for c in split):
                continue
            key = tuple(sorted(tuple(sorted(c)) for c in split))
            if key not in seen:
                seen.add(key)
                yield m, kind, split


def sorted_split(lengths, m: int, order=None) -> list[list[int]]:
    """FlexSP's split (§4.2): sort descending, cut into at most m consecutive chunks that minimise the largest
    chunk's tokens (the linear-partition argument: binary search on the bound, greedy check by prefix sums, greedy
    filling uses the fewest chunks for a fixed bound), then split the largest chunks until there are min(m, K)."""
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
    """Longest-first into the micro-batch with the least work that still has memory room, ties to the first; None
    if a sequence fits none."""
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


def tiered_split(
    lengths,
    work,
    wall,
    min_devices,
    num_devices: int,
    *,
    capacity_tokens: int,
    extra: int = 0,
    ratio: float = TIER_RATIO,
    fill: float = 0.95,
    own=None,
    seeds=None,
    squeeze: bool = False,
) -> list[list[int]] | None:
    """Slow sequences in micro-batches of their own, the rest balanced (None when the rest cannot be split).

    Repeatedly, over the sequences not yet placed: the average micro-batch's share of their work is
    ``sum(work) / N / M`` with M = their memory minimum + `extra`; the sequences whose least wall time `wall` is over
    `ratio` times that, slowest first, go first-fit into the tiered micro-batches so far, where they fit side by side:
    the groups they need (`min_devices`, the least degree that holds each) add up to at most N devices and their
    tokens to `fill` of the memory. Then the next tier. With `own` = (devices, time) of each sequence on its
    least-device-time group, each tiered micro-batch is then topped up, slowest first, with the sequences left that
    run on such a group of their own within its makespan on the devices it leaves free (they cost it nothing). What
    is left is split by :func:`balanced_split`. ``seeds``: micro-batches placed before any tier, as (members, devices
    their groups take, makespan) for the j slowest, j = 1, 2, ... (``solver.round_bounds.best_round_split``): those
    of the most of them this ratio tiers (None when it tiers none of them). ``squeeze``: the split of the fewest
    micro-batches memory allows, the tiered micro-batches taking the shortest of the rest where the rest would need
    one more (:func:`_squeeze`; None where it would not).
    ``work[i]`` is sequence i's least device-time (``solver.bounds.area_and_min_time``), ``wall[i]`` its least time.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    work = np.asarray(work, dtype=np.float64)
    wall = np.asarray(wall, dtype=np.float64)
    need = np.asarray(min_devices, dtype=np.int64)
    chunks: list[list] = []  # [members, devices, tokens, makespan or None (its slowest sequence's wall time)]
    if seeds:  # the rounds of as many of the slowest as this ratio tiers
        chunks = _seed_chunks(seeds, lengths, work, wall, num_devices, capacity_tokens, extra, ratio)
        if chunks is None:
            return None  # the plain tiered split covers it
    placed = np.zeros(lengths.size, dtype=bool)
    placed[[i for c in chunks for i in c[0]]] = True
    rest = np.flatnonzero(~placed)
    rest = _tier_slowest(chunks, rest, lengths, work, wall, need, num_devices, capacity_tokens, extra, ratio, fill)
    if not chunks:
        return None  # no tier: the balanced split is the same
    if own is not None and rest.size:
        rest = _top_up(chunks, rest, own, lengths, wall, num_devices, capacity_tokens, fill)
    if squeeze:
        rest = _squeeze(chunks, rest, lengths, capacity_tokens, fill)
        if rest is None:
            return None
    out = [c[0] for c in chunks]
    if rest.size:
        split = _balance_rest(rest, lengths, work, capacity_tokens, extra)
        if split is None:
            return None
        out += split
    return out


def _seed_chunks(seeds, lengths, work, wall, num_devices: int, capacity_tokens: int, extra: int, ratio: float):
    """The tiered split's first micro-batches: the seeds of the most of the slowest this ratio tiers (None: none)."""
    m = max(1, math.ceil(int(lengths.sum()) / capacity_tokens)) + extra
    share = float(work.sum()) / num_devices / m
    slow = 0
    while slow < len(seeds) and seeds[slow] and all(wall[i] > ratio * share for r in seeds[slow] for i in r[0]):
        slow += 1
    if slow == 0:
        return None
    return [
        [list(members), int(devices), int(lengths[list(members)].sum()), float(span)]
        for members, devices, span in seeds[slow - 1]
    ]


def _tier_slowest(chunks, rest, lengths, work, wall, need, num_devices, capacity_tokens, extra, ratio, fill):
    """Tier by tier, the sequences of `rest` slow against the average micro-batch placed first-fit side by side in
    `chunks` (changed in place); returns the sequences left."""
    while rest.size:
        m = max(1, math.ceil(int(lengths[rest].sum()) / capacity_tokens)) + extra
        share = float(work[rest].sum()) / num_devices / m
        slow = rest[wall[rest] > ratio * share]
        if slow.size == 0:
            break
        for i in slow[np.argsort(-wall[slow], kind="stable")].tolist():
            for c in chunks:
                if c[1] + need[i] <= num_devices and c[2] + lengths[i] <= fill * capacity_tokens:
                    c[0].append(i)
                    c[1] += int(need[i])
                    c[2] += int(lengths[i])
                    break
            else:
                chunks.append([[i], int(need[i]), int(lengths[i]), None])
        rest = rest[wall[rest] <= ratio * share]
    return rest


def _top_up(chunks, rest, own, lengths, wall, num_devices: int, capacity_tokens: int, fill: float):
    """Each tiered micro-batch of `chunks` topped up, slowest first, with the sequences of `rest` that run on a
    least-device-time group of their own (`own`) within its makespan on the devices it leaves free; the rest left."""
    own_dev, own_time = (np.asarray(x) for x in own)
    left = rest[np.argsort(-wall[rest], kind="stable")].tolist()
    for c in chunks:
        span = float(wall[c[0]].max()) if c[3] is None else c[3]
        keep = []
        for pos, i in enumerate(left):
            if c[1] >= num_devices:  # no device left: nothing more fits (a group takes at least one)
                keep += left[pos:]
                break
            if c[1] + own_dev[i] <= num_devices and c[2] + lengths[i] <= fill * capacity_tokens and own_time[i] <= span:
                c[0].append(i)
                c[1] += int(own_dev[i])
                c[2] += int(lengths[i])
            else:
                keep.append(i)
        left = keep
    return np.array(sorted(left), dtype=np.int64)


def _balance_rest(rest, lengths, work, capacity_tokens: int, extra: int) -> list[list[int]] | None:
    """The sequences left after the tiers (`rest`) by :func:`balanced_split`, as lists of sequence indices."""
    m = max(1, math.ceil(int(lengths[rest].sum()) / capacity_tokens)) + extra
    sub_len = lengths[rest]
    even = min(capacity_tokens, max(int(sub_len.max()), math.ceil(sub_len.sum() / m * 1.08)))
    split = balanced_split(sub_len, work[rest], m, even) or balanced_split(sub_len, work[rest], m, capacity_tokens)
    if split is None:
        return None
    return [rest[c].tolist() for c in split]


def _squeeze(chunks, rest, lengths, capacity_tokens: int, fill: float):
    """The rest of a tiered split after the tiered micro-batches (``chunks``) took the shortest of it, the cheapest
    on their large groups, until the rest fits the fewest micro-batches memory allows (at ``fill``): a sequence that
    runs fastest on all N devices and the short ones that would need one micro-batch more share its group (one
    more micro-batch costs its fixed cost). None where the rest fits already, or cannot be made to."""
    total = sum(int(lengths[c[0]].sum()) for c in chunks) + int(lengths[rest].sum())
    fewest = max(1, math.ceil(total / capacity_tokens))
    room = fewest - len(chunks)  # micro-batches left for the rest
    toks = int(lengths[rest].sum())
    if room < 1 or math.ceil(toks / capacity_tokens) <= room:
        return None
    limit = room * fill * capacity_tokens
    moved = np.zeros(lengths.size, dtype=bool)
    for i in rest[np.argsort(lengths[rest], kind="stable")].tolist():
        if toks <= limit:
            break
        for c in chunks:
            if c[2] + lengths[i] <= fill * capacity_tokens:
                c[0].append(i)
                c[2] += int(lengths[i])
                moved[i] = True
                toks -= int(lengths[i])
                break
    return rest[~moved[rest]] if toks <= limit else None
