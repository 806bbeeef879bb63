"""InfiniPipe's workload-balanced chunking of one step's batch into pipeline units (arXiv 2509.21275, §4).

A *unit* is what a pipeline stage runs forward (and later backward) in one go: either one Seq1F1B segment of a long
sequence (``flexorch.solver.pipeline.segments``: equal work, later segments attend to the K/V of earlier ones) or
several whole short
sequences packed together. Per step:

1. the time target ``T = total work / K`` for a chosen granularity K (the number of units aimed at);
2. a sequence whose work exceeds T, or whose tokens exceed the token cap (activation memory of one unit), is split
   into the fewest equal-work segments that meet both;
3. the other sequences are packed best-fit decreasing into units under the same two caps (a new unit opens when
   none fits), so unit costs are similar;
4. units are ordered longest sequence first: a split sequence's segments stay consecutive and in order (its
   backward runs them in reverse), then packed units by decreasing work.

Work is the cost model's a1*s^2 + a2*s (docs/design.md §2.1); :func:`choose_chunking` in
``flexorch.solver.pipeline.plan`` picks K per step by simulating the schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flexorch.solver.pipeline.segments import equal_flop_boundaries, segment_cost

__all__ = ["MAX_SEGMENTS", "Piece", "Unit", "chunk_batch"]

MAX_SEGMENTS = 4096
"""More segments than this for one sequence is refused (the step would be all per-unit overhead)."""


@dataclass(frozen=True)
class Piece:
    """Tokens [start, end) of sequence ``seq`` of the batch."""

    seq: int
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Unit:
    """One pipeline unit: a segment of one long sequence, or several whole short sequences."""

    pieces: tuple[Piece, ...]
    chain: int
    """Units with the same chain are the segments of one sequence, in order (forward in order, backward reversed)."""
    position: int
    """Index of this segment inside its chain (0 for a packed unit, which is a chain of its own)."""
    work: float
    """a1*s^2 + a2*s summed over the pieces (a segment pays for its prefix: F(end) - F(start))."""

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.pieces)

    @property
    def prefix(self) -> int:
        """Tokens of earlier segments this unit's pieces attend to (their K/V cache)."""
        return sum(p.start for p in self.pieces)


def chunk_batch(lengths, granularity: int, a1: float, a2: float, token_cap: int, align: int = 1) -> list[Unit]:
    """Split and pack ``lengths`` into about ``granularity`` units of similar work (see the module docstring)."""
    lengths = [int(s) for s in lengths]
    if not lengths:
        raise ValueError("cannot chunk an empty batch")
    if any(s < 1 for s in lengths):
        i = next(i for i, s in enumerate(lengths) if s < 1)
        raise ValueError(f"sequence {i} is empty ({lengths[i]} tokens); drop empty sequences before planning")
    if granularity < 1:
        raise ValueError(f"granularity must be >= 1, got {granularity}")
    if token_cap < align:
        raise ValueError(f"token_cap {token_cap} is below the segment alignment {align}")
    work = [segment_cost(0, s, a1, a2) for s in lengths]
    target = sum(work) / granularity
    units: list[Unit] = []
    chain = 0
    short = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        s = lengths[i]
        if work[i] <= target * (1 + 1e-9) and s <= token_cap:
            short.append(i)
            continue
        # equal-work segments: the first is the longest in tokens, so it sets the memory; it is <= token_cap
        # exactly when F(S)/k <= F(token_cap), so start there (rounding may need a few more)
        k = max(1, math.ceil(work[i] / target - 1e-9), math.ceil(work[i] / segment_cost(0, token_cap, a1, a2) - 1e-9))
        while True:
            if k > MAX_SEGMENTS or k * align > s:
                raise ValueError(
                    f"sequence {i} ({s} tokens) would need more than {min(MAX_SEGMENTS, s // align)} segments of at "
                    f"most {token_cap} tokens (what one unit may hold on a stage); add stages or workers per stage, "
                    "or lower the context length"
                )
            xs = equal_flop_boundaries(s, k, a1, a2, align)
            if max(b - a for a, b in zip(xs, xs[1:], strict=False)) <= token_cap:
                break
            k += 1
        for j, (a, b) in enumerate(zip(xs, xs[1:], strict=False)):
            units.append(Unit((Piece(i, a, b),), chain, j, segment_cost(a, b, a1, a2)))
        chain += 1
    bins: list[list[int]] = []
    loads: list[tuple[float, int]] = []
    for i in sorted(short, key=lambda i: -work[i]):
        best, room = None, None
        for b, (w, t) in enumerate(loads):
            if w + work[i] <= target * (1 + 1e-9) and t + lengths[i] <= token_cap:
                left = target - w - work[i]
                if room is None or left < room:
                    best, room = b, left
        if best is None:
            bins.append([i])
            loads.append((work[i], lengths[i]))
        else:
            bins[best].append(i)
            w, t = loads[best]
            loads[best] = (w + work[i], t + lengths[i])
    packed = sorted(zip(bins, loads, strict=True), key=lambda bl: -bl[1][0])
    for seqs, (w, _) in packed:
        units.append(Unit(tuple(Piece(i, 0, lengths[i]) for i in seqs), chain, 0, w))
        chain += 1
    return units
