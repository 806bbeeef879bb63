"""Seq1F1B segment boundaries: split a causal sequence into k segments of equal work (arXiv 2406.03488, §3.3).

With causal attention, token t attends to t+1 tokens, so the work of tokens [0, x) is

    F(x) = a1 * x^2 + a2 * x                      (the cost model's sequence time, docs/design.md §2.1)

and segment [x_{i-1}, x_i) costs F(x_i) - F(x_{i-1}). Equal work means F(x_i) = i/k * F(S), i.e. the positive root

    x_i = (-a2 + sqrt(a2^2 + 4 a1 * i/k * F(S))) / (2 a1)           (attention alone, a2 = 0: x_i = S * sqrt(i/k))

which is the same as solving Seq1F1B's per-segment quadratic a1 (b^2 - a^2) + a2 (b - a) = F(S)/k for the start a
of each segment from the tail end b = S backwards. Later segments are shorter: they attend to a longer prefix.
Boundaries are rounded to integers (optionally to a multiple of ``align`` tokens, e.g. 2*d for a zigzag ring
group), keeping every segment at least ``align`` tokens and the lengths summing to S.
"""

from __future__ import annotations

import math

__all__ = ["segment_cost", "equal_flop_boundaries", "equal_flop_segments"]


def segment_cost(start: int, end: int, a1: float, a2: float) -> float:
    """Work of tokens [start, end) of a causal sequence: F(end) - F(start) with F(x) = a1 x^2 + a2 x."""
    return a1 * (end * end - start * start) + a2 * (end - start)


def equal_flop_boundaries(length: int, k: int, a1: float, a2: float = 0.0, align: int = 1) -> list[int]:
    """The k+1 boundaries 0 = x_0 < x_1 < ... < x_k = length of k equal-work segments."""
    if length < 1:
        raise ValueError(f"a sequence to split must have at least one token, got {length}")
    if k < 1:
        raise ValueError(f"the number of segments must be >= 1, got {k}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    if a1 < 0 or a2 < 0 or a1 + a2 <= 0:
        raise ValueError(f"the cost coefficients must be >= 0 and not both 0, got a1={a1}, a2={a2}")
    if k * align > length:
        raise ValueError(
            f"cannot split {length} tokens into {k} segments of at least {align} tokens each; use at most "
            f"{length // align} segments"
        )
    total = segment_cost(0, length, a1, a2)
    xs = [0]
    for i in range(1, k):
        target = total * i / k
        x = (-a2 + math.sqrt(a2 * a2 + 4 * a1 * target)) / (2 * a1) if a1 > 0 else target / a2
        x = int(round(x / align)) * align
        lo, hi = xs[-1] + align, length - (k - i) * align  # room for the segments still to come
        xs.append(min(max(x, lo), hi))
    xs.append(length)
    return xs


def equal_flop_segments(length: int, k: int, a1: float, a2: float = 0.0, align: int = 1) -> list[int]:
    """Lengths of the k equal-work segments, first to last (they sum to ``length``)."""
    xs = equal_flop_boundaries(length, k, a1, a2, align)
    return [b - a for a, b in zip(xs, xs[1:], strict=False)]
