"""Shared pieces of the solver tests: a tiny profile whose memory and communication bite at toy sizes (and variants
with collective latency), and a brute-force optimum over every plan (every split into micro-batches, every
grouping, every group type)."""

from __future__ import annotations

from functools import cache
from itertools import combinations

import numpy as np

from flexorch.solver.cost_model import group_overhead_ms
from flexorch.solver.packing import group_types, time_table
from flexorch.solver.profiles import Profile

TINY = Profile(
    name="tiny",
    a1_ms=1e-3,
    a2_ms=0.1,
    b1_ms=5.0,
    act_bytes_per_token=100.0,
    memory_budget_bytes=100.0 * 100.0,
    num_layers=1,
    hidden=4,
    num_heads=4,
    num_kv_heads=2,
    bytes_per_element=2,
    a2a_gbps={2: 8e-4, 4: 6e-4, 8: 2e-4},
)  # 100 tokens per device (92 and 86 in Ulysses groups of 2 and 4: their all-to-all copies); Ulysses up to
# degree 4 (4 heads), ring beyond

# TINY with per-degree collective latency (Profile.a2a_latency_ms / p2p_latency_ms), as gloo on CPU has it
# (docs/design.md §7). "small": latency next to b1 (ring falls back to the Ulysses table); "large": SP over short
# sequences never pays, ring-4 takes the ring-8 latency (the next larger measured degree); "ring": ring cheaper
# than Ulysses at degree 2, dearer at 4 (Ulysses-2 takes the Ulysses-4 latency).
TINY_LATENCY = {
    "small": TINY.with_overrides(name="tiny-lat-small", a2a_latency_ms={2: 3.0, 4: 6.0, 8: 12.0}),
    "large": TINY.with_overrides(
        name="tiny-lat-large", a2a_latency_ms={2: 40.0, 4: 80.0}, p2p_latency_ms={2: 25.0, 8: 150.0}
    ),
    "ring": TINY.with_overrides(
        name="tiny-lat-ring", a2a_latency_ms={4: 2.0}, p2p_latency_ms={2: 1.0, 4: 9.0, 8: 30.0}
    ),
}
TINY_PROFILES = {"none": TINY, **TINY_LATENCY}


def set_partitions(items):
    items = list(items)
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield part[:i] + [[first, *part[i]]] + part[i + 1 :]


def brute_force_optimum(lengths, num_devices: int, profile: Profile) -> tuple[float, float]:
    """(best step time over all plans, best time with a single micro-batch) under the cost model."""
    lengths = np.asarray(lengths, dtype=np.int64)
    types = group_types(num_devices, profile)
    table = time_table(lengths, types, profile)
    overheads = [group_overhead_ms(t.degree, t.kind, profile) for t in types]  # b1 + latency, per group
    caps = [profile.group_token_cap(t.kind, t.degree) for t in types]  # Ulysses holds a little less than ring

    @cache
    def mb_opt(subset: frozenset) -> float:
        best = np.inf
        for part in set_partitions(sorted(subset)):
            opts = []
            for block in part:
                tok = int(lengths[block].sum())
                o = [
                    (float(overheads[t]) + float(table[block, t].sum()), types[t].degree)
                    for t in range(len(types))
                    if np.isfinite(table[block, t]).all() and tok <= caps[t]
                ]
                if not o:
                    break
                opts.append(o)
            else:
                for c in sorted({tm for o in opts for tm, _ in o}):
                    if c >= best:
                        break
                    need = sum(min((d for tm, d in o if tm <= c), default=10**9) for o in opts)
                    if need <= num_devices:
                        best = c
                        break
        return best

    @cache
    def step_opt(rest: frozenset) -> float:
        if not rest:
            return 0.0
        first = min(rest)
        others = sorted(rest - {first})
        best = np.inf
        for r in range(len(others) + 1):
            for comb in combinations(others, r):
                block = frozenset((first, *comb))
                v = mb_opt(block)
                if v < best:
                    best = min(best, v + step_opt(rest - block))
        return best

    everything = frozenset(range(lengths.size))
    return step_opt(everything), mb_opt(everything)
