"""FlexSP's time and memory model for one sequence on one SP group (arXiv 2412.01523, §4.1.2).

For a sequence of s tokens on an SP group of degree d (all d devices work on it together):

* compute:  (a1*s^2 + a2*s) / d                       (quadratic term: causal attention; linear: the rest)
* Ulysses:  + bytes(s) / (d * bw_a2a[d])             bytes(s) = 4 all-to-alls/layer * 2 (fwd+bwd) * L * h * s * 2 B
                                                      (q, o carry h; k, v carry h_kv*head_dim under GQA)
* ring:     the attention term becomes d ring steps that overlap a block of compute with one K/V exchange,
            c = a1*s^2/d^2 per step (zigzag layout balances causal work), m = one step's bytes / bw_p2p[d]:
            attention = c + (d-1) * max(c, m)        (first block is local; docs/design.md §2.1 "max(compute, comm)")
            one step's bytes = 3 (K/V fwd, K/V + dK/dV bwd, counted as K,V + 2x) * 2 * (s/d) * h_kv*hd * 2 B * L
* overhead: a group pays a fixed cost once per micro-batch, b1 + latency(kind, d) (`group_overhead_ms`), and a
            group's time is that plus the sum of its sequences' times.
            latency(kind, d) is flexorch's extension of FlexSP's model (FlexSP has b1 alone): the per-collective
            latency a group of d > 1 pays for its all-to-alls (Ulysses: 4 per layer forward + 4 backward) or ring
            steps (d-1 K/V exchanges per layer forward, ~d backward) whatever its tokens, measured per docs/design.md §7
            (gloo on CPU: ~0.9 ms per collective for 2 ranks, ~1.9 ms for 4) and stored per degree in the profile
            (`Profile.a2a_latency_ms`, `Profile.p2p_latency_ms`; 0 when not measured, and 0 for d == 1).
* memory:   a group of degree d holds at most d * tokens_per_device tokens (s/d * act_per_token per device); a
            Ulysses group's tokens also cost its all-to-all copies (``Profile.act_bytes_per_local_token``), so it
            holds ``Profile.group_token_cap("ulysses", d)``, a few per cent less.

All times are milliseconds.
"""

from __future__ import annotations

import math

import numpy as np

from flexorch.solver.profiles import Profile

__all__ = [
    "KINDS",
    "GROUP_KINDS",
    "ULYSSES",
    "RING",
    "HYBRID",
    "next_pow2",
    "min_degree",
    "seq_time_ms",
    "seq_times_ms",
    "group_overhead_ms",
    "group_time_ms",
    "group_comm_ms",
    "kind_allowed",
    "comm_bytes",
]

ULYSSES = "ulysses"
RING = "ring"
HYBRID = "hybrid"
KINDS = (ULYSSES, RING)
"""The one-dimensional kinds: every device of the group runs the same collective."""
GROUP_KINDS = (ULYSSES, RING, HYBRID)
"""Every kind a plan's group may have: ``hybrid`` is Ulysses over ``u`` ranks inside a node times zigzag ring over
``r = d / u`` ranks across nodes (USP / yunchang's 2-D sequence parallel, Megatron-Core's hierarchical context
parallel); its group names ``u`` (``Group.ulysses_degree``)."""


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (1 for x <= 1)."""
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def min_degree(s: int, tokens_per_device: int) -> int:
    """Smallest power-of-two SP degree whose devices hold s tokens: next_pow2(ceil(s / tokens_per_device))."""
    return next_pow2(math.ceil(s / tokens_per_device))


def kind_allowed(kind: str, d: int, profile: Profile) -> bool:
    """Ulysses shards heads, so it needs num_heads % d == 0; ring attention works for any degree."""
    if kind == ULYSSES:
        return profile.num_heads % d == 0
    if kind == RING:
        return True
    raise ValueError(f"unknown attention kind {kind!r}; expected one of {KINDS}")


def _ulysses_bytes_per_token(profile: Profile) -> float:
    # per layer and direction, all-to-alls of q and o (h each) and of k and v (h_kv * head_dim each); with
    # h_kv == h this is FlexSP's 4 all-to-alls * 2 (fwd+bwd) * L * h * 2 bytes
    kv_dim = profile.num_kv_heads * profile.head_dim
    return 2 * profile.num_layers * (2 * profile.hidden + 2 * kv_dim) * profile.bytes_per_element


def _ring_step_bytes_per_token(profile: Profile) -> float:
    kv_dim = profile.num_kv_heads * profile.head_dim
    return 3 * 2 * kv_dim * profile.bytes_per_element * profile.num_layers


def comm_bytes(s: int, d: int, kind: str, profile: Profile) -> float:
    """Bytes one device sends for a sequence of s tokens on a group of d (0 for d == 1)."""
    if d == 1:
        return 0.0
    if kind == ULYSSES:
        return _ulysses_bytes_per_token(profile) * s / d
    return (d - 1) * _ring_step_bytes_per_token(profile) * s / d


def seq_times_ms(lengths: np.ndarray, d: int, kind: str, profile: Profile) -> np.ndarray:
    """Vectorised time (ms) of each sequence in `lengths` alone on a group of degree d with `kind` attention."""
    s = np.asarray(lengths, dtype=np.float64)
    attn = profile.a1_ms * s * s
    linear = profile.a2_ms * s
    if d == 1:
        return attn + linear
    if kind == ULYSSES:
        bw = profile.bandwidth_gbps(d) * 1e9  # bytes/s
        comm = _ulysses_bytes_per_token(profile) * s / (d * bw) * 1e3
        return (attn + linear) / d + comm
    if kind == RING:
        bw = profile.bandwidth_gbps(d, ring=True) * 1e9
        c = attn / (d * d)
        m = _ring_step_bytes_per_token(profile) * (s / d) / bw * 1e3
        return c + (d - 1) * np.maximum(c, m) + linear / d
    raise ValueError(f"unknown attention kind {kind!r}; expected one of {KINDS}")


def seq_time_ms(s: int, d: int, kind: str, profile: Profile) -> float:
    """Time (ms) of one sequence of s tokens on a group of degree d."""
    return float(seq_times_ms(np.array([s]), d, kind, profile)[0])


def group_overhead_ms(d: int, kind: str, profile: Profile) -> float:
    """Fixed cost (ms) of one group of degree d with `kind` attention per micro-batch: b1 + collective latency.

    b1 is FlexSP's per-group overhead (§4.1.2); the latency term (0 for d == 1) is flexorch's extension, measured
    per docs/design.md §7: all the collectives of one micro-batch cost at least this much, however few tokens they move.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown attention kind {kind!r}; expected one of {KINDS}")
    return profile.b1_ms + profile.latency_ms(d, ring=kind == RING)


def group_time_ms(lengths, d: int, kind: str, profile: Profile) -> float:
    """Overhead (b1 + latency) + the summed sequence times: one group's time in one micro-batch (0 when empty)."""
    if len(lengths) == 0:
        return 0.0
    return group_overhead_ms(d, kind, profile) + float(seq_times_ms(np.asarray(lengths), d, kind, profile).sum())


def group_comm_ms(lengths, d: int, kind: str, profile: Profile) -> float:
    """The communication part of :func:`group_time_ms`: collective latency plus the all-to-all time (Ulysses) or
    the ring's exposed transfer time, what ``max(c, m)`` adds over compute (0 for d == 1 or an empty group)."""
    if d == 1 or len(lengths) == 0:
        return 0.0
    s = np.asarray(lengths, dtype=np.float64)
    if kind == ULYSSES:
        bw = profile.bandwidth_gbps(d) * 1e9
        moved = float((_ulysses_bytes_per_token(profile) * s / (d * bw) * 1e3).sum())
    else:
        bw = profile.bandwidth_gbps(d, ring=True) * 1e9
        c = profile.a1_ms * s * s / (d * d)
        m = _ring_step_bytes_per_token(profile) * (s / d) / bw * 1e3
        moved = float(((d - 1) * np.maximum(m - c, 0.0)).sum())
    return profile.latency_ms(d, ring=kind == RING) + moved
