"""Bucketing DP and the micro-batch splits (``solver.microbatching``: FlexSP's sorted min-max split, the balanced
split) against brute force on small inputs."""

from itertools import combinations

import numpy as np
import pytest

from flexorch.solver.bucketing import optimal_buckets, padding_tokens
from flexorch.solver.microbatching import balanced_split, sorted_split


def _brute_padding(lengths, q):
    v = np.unique(lengths)
    best = None
    for k in range(1, min(q, v.size) + 1):
        for cuts in combinations(range(1, v.size), k - 1):
            edges = [0, *cuts, v.size]
            pad = 0
            for a, b in zip(edges, edges[1:], strict=False):
                top = v[b - 1]
                members = lengths[(lengths >= v[a]) & (lengths <= top)]
                pad += int((top - members).sum())
            best = pad if best is None else min(best, pad)
    return best


@pytest.mark.parametrize("seed", range(25))
def test_bucketing_dp_is_optimal(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, size=int(rng.integers(1, 12)))
    q = int(rng.integers(1, 5))
    buckets = optimal_buckets(lengths, q)
    assert len(buckets) <= q
    members = sorted(i for b in buckets for i in b.members)
    assert members == list(range(lengths.size))
    for b in buckets:
        assert all(lengths[i] <= b.upper for i in b.members)
    assert padding_tokens(lengths, buckets) == _brute_padding(lengths, q)


def test_bucketing_edge_cases():
    assert optimal_buckets([], 4) == []
    one = optimal_buckets([7, 7, 7], 3)
    assert len(one) == 1 and padding_tokens([7, 7, 7], one) == 0
    with pytest.raises(ValueError):
        optimal_buckets([1, 2], 0)


def _brute_minmax(t, m):
    best = None
    for k in range(1, min(m, len(t)) + 1):
        for cuts in combinations(range(1, len(t)), k - 1):
            edges = [0, *cuts, len(t)]
            worst = max(sum(t[a:b]) for a, b in zip(edges, edges[1:], strict=False))
            best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(25))
def test_sorted_split_is_min_max_optimal(seed):
    rng = np.random.default_rng(100 + seed)
    t = sorted(rng.integers(1, 50, size=int(rng.integers(1, 10))).tolist(), reverse=True)
    m = int(rng.integers(1, 5))
    split = sorted_split(t, m)
    assert [i for c in split for i in c] == list(range(len(t)))  # consecutive chunks of the sorted lengths
    assert max(sum(t[i] for i in c) for c in split) == _brute_minmax(t, m)
    assert len(split) == min(m, len(t))


def test_sorted_and_balanced_splits_cover_every_sequence_once():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 1000, size=50)
    for m in (1, 2, 5):
        for split in (sorted_split(lengths, m), balanced_split(lengths, lengths * 1.0, m, 10**9)):
            assert sorted(i for c in split for i in c) == list(range(50))
    srt = sorted_split(lengths, 3)
    assert min(lengths[srt[0]]) >= max(lengths[srt[1]])  # FlexSP: longest sequences together
    assert balanced_split(lengths, lengths * 1.0, 2, 100) is None  # a sequence fits nowhere
