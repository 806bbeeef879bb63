"""A fast estimate of one task's time per layer on n devices, from FlexSP's cost model (arXiv 2412.01523, §4.1.2).

Spindle (arXiv 2409.03365, §4.1) needs, for every MetaOp, its time as a function of the devices it gets. Here a
MetaOp is a task's pass through identical transformer layers over the task's own batch, so its time on n devices is
the time of an SP plan of that batch on n devices. Solving the SP planner for every (task, n) would be too slow
for a per-step planner, so this module *estimates* it (flexorch's own rule, not the paper's profiling fit):

* n is a valid device count: a power of two up to the largest power of two <= N;
* for every base degree d <= n and attention kind (Ulysses where ``num_heads % d == 0``, ring always) the batch
  runs as at most two micro-batches, one after the other:
    - the *long* sequences, those that need a degree above d by the memory rule (``group_token_cap``), on
      n / D groups of degree D = the largest degree any of them needs (skipped when there are none);
    - the rest on n / d groups of degree d;
  each micro-batch is packed longest-processing-time first (LPT) on the sequences' times, and a group pays its
  fixed cost (``group_overhead_ms``: b1 + collective latency) once per ``ceil(tokens / group_token_cap)``
  micro-batches it needs for memory;
* T(n) is the best such estimate over d and kind; then T is made non-increasing in n by a running minimum (a task
  never has to use more devices than help it: given n it may leave some idle);
* a LoRA adapter of rank r adds ``ADAPTER_COST * r / hidden`` to the linear per-token cost (a2): an adapter on the
  four attention projections does 4 * 2 * 2*h*r FLOPs per token forward against the base layer's ~24 h^2, so
  (16 h r) / (24 h^2) = (2/3) r / h; the adapter's parameters and optimizer state are ignored in memory;
* profile times cover all ``profile.num_layers`` layers; times here are per layer (divided by it).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from flexorch.solver.cost_model import KINDS, group_overhead_ms, kind_allowed, seq_times_ms
from flexorch.solver.profiles import Profile

__all__ = ["ADAPTER_COST", "adapter_profile", "layer_times_ms", "valid_counts"]

ADAPTER_COST = 2.0 / 3.0
"""Extra linear cost per token of a rank-r adapter, as a fraction of a2 per unit of r / hidden (see above)."""


def valid_counts(num_devices: int) -> tuple[int, ...]:
    """The device counts a MetaOp may run on: 1, 2, 4, ... up to the largest power of two <= num_devices."""
    return tuple(1 << k for k in range(int(num_devices).bit_length()))


def adapter_profile(profile: Profile, adapter_rank: int) -> Profile:
    """``profile`` with the linear term grown by a rank-``adapter_rank`` adapter: a2 * (1 + ADAPTER_COST * r / h)."""
    if adapter_rank == 0:
        return profile
    return profile.with_overrides(a2_ms=profile.a2_ms * (1.0 + ADAPTER_COST * adapter_rank / profile.hidden))


def _lpt(times: np.ndarray, tokens: np.ndarray, groups: int, overhead: float, cap: int) -> float:
    """Makespan of LPT over ``groups`` identical groups; `times` sorted descending. A group pays ``overhead`` once per
    micro-batch, ``ceil(tokens / cap)`` of them."""
    if times.size == 0:
        return 0.0
    if times.size <= groups:  # one sequence per group
        return float(times[0] + overhead * math.ceil(tokens.max() / cap))
    heap = [(0.0, 0, g) for g in range(groups)]  # (load, tokens, group)
    for t, s in zip(times.tolist(), tokens.tolist(), strict=True):
        load, tok, g = heap[0]
        heapq.heapreplace(heap, (load + t, tok + s, g))
    return max(load + overhead * math.ceil(tok / cap) for load, tok, _ in heap)


def layer_times_ms(lengths, num_devices: int, profile: Profile, adapter_rank: int = 0) -> tuple[float, ...]:
    """Estimated time per layer (ms) of the batch `lengths` on n = 1, 2, 4, ... <= num_devices devices; ``inf``
    where n devices cannot hold some sequence. Non-increasing in n (running minimum)."""
    prof = adapter_profile(profile, adapter_rank)
    counts = valid_counts(num_devices)
    s = np.sort(np.asarray(lengths, dtype=np.int64))[::-1]
    per_layer = 1.0 / profile.num_layers
    kinds = [(k, d) for d in counts for k in KINDS if kind_allowed(k, d, prof)]
    cap = {(k, d): prof.group_token_cap(k, d) for k, d in kinds}
    times = {(k, d): seq_times_ms(s, d, k, prof) * per_layer for k, d in kinds}
    over = {(k, d): group_overhead_ms(d, k, prof) * per_layer for k, d in kinds}
    # need[k][i]: least degree whose group of kind k holds sequence i (a huge value when none does)
    need = {}
    for k in KINDS:
        n_k = np.full(s.size, 1 << 62, dtype=np.int64)
        for d in reversed(counts):
            if (k, d) in cap:
                n_k[s <= cap[k, d]] = d
        need[k] = n_k
    memo: dict[tuple, float] = {}

    def phase(mask_key, items: np.ndarray, degree: int, n: int) -> float:
        best = math.inf
        for k in KINDS:
            if (k, degree) not in cap or (items.size and need[k][items].max() > degree):
                continue
            key = (mask_key, k, degree, n // degree)
            if key not in memo:
                memo[key] = _lpt(times[k, degree][items], s[items], n // degree, over[k, degree], cap[k, degree])
            best = min(best, memo[key])
        return best

    least_need = np.minimum(need["ulysses"], need["ring"])
    out = []
    for n in counts:
        best = math.inf
        for d in counts:
            if d > n:
                break
            long_items = np.flatnonzero(least_need > d)
            short_items = np.flatnonzero(least_need <= d)
            t = phase(("short", d), short_items, d, n)
            if long_items.size:
                big = int(least_need[long_items].max())
                t = t + (phase(("long", d), long_items, big, n) if big <= n else math.inf)
            best = min(best, t)
        out.append(min(best, out[-1]) if out else best)
    return tuple(out)
