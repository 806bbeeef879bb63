"""Candidate micro-batch splits of one step (Sequence Blaster, FlexSP §4.2), shared by planner and baselines."""

from __future__ import annotations

import math

import numpy as np

from flexorch.solver.blaster import balanced_chunks, sorted_chunks

__all__ = ["partition_candidates"]


def partition_candidates(lengths, work, capacity_tokens: int, extra: int = 4) -> list[list[list[int]]]:
    """Splits into M = M_min .. M_min + extra micro-batches, a balanced one and FlexSP's sorted one for each.

    A split is kept only when every micro-batch fits `capacity_tokens` (the tokens all N devices hold).
    Duplicates are removed; order is by M then strategy.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    m_min = max(1, math.ceil(int(lengths.sum()) / capacity_tokens))
    seen, out = set(), []
    for m in range(m_min, min(m_min + extra, lengths.size) + 1):
        # balanced work with tokens kept near the mean too: a micro-batch filled to the last token of memory
        # leaves the packer no room (only one group of all N devices can hold it)
        even = min(capacity_tokens, max(int(lengths.max()), math.ceil(lengths.sum() / m * 1.08)))
        balanced = balanced_chunks(lengths, work, m, even) or balanced_chunks(lengths, work, m, capacity_tokens)
        for split in (balanced, sorted_chunks(lengths, m)):
            if split is None or any(int(lengths[c].sum()) > capacity_tokens for c in split):
                continue
            key = tuple(sorted(tuple(sorted(c)) for c in split))
            if key not in seen:
                seen.add(key)
                out.append(split)
    return out
