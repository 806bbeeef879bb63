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
* placement (``solver.topology``): a group whose ranks span nodes (``spans=True``) is priced with the profile's
            inter-node tables (``Profile.inter_a2a_gbps`` ...: its collectives cross the slow link); one inside a
            node with the tables above. A profile without inter tables prices both alike, and ``spans`` defaults to
            False: a call without a placement is priced as inside one node.
* hybrid:   Ulysses over u ranks inside a node x zigzag ring over r = d/u ring positions across nodes
            (:func:`hybrid_seq_times_ms`, derivation there).
* windows:  a model whose layers (a share f of them) attend within a sliding window of w tokens pays, in those
            layers, attention over ``2 s w - w^2`` key-query pairs (twice the pairs of ``w^2/2 + (s - w) w``, the
            window's band) instead of ``s^2`` once s > w: ``s^2`` in every a1 term above becomes
            ``attention_square(s) = (1 - f) s^2 + f min(s^2, 2 s w - w^2)`` (Gemma 3 slides 5 layers of 6, so a
            32K-token document with a 1K window costs about a fifth of the quadratic model's attention). The ring's
            K/V still travels the whole ring, so its exchange term is unchanged.
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
    "attention_square",
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
    "hybrid_seq_times_ms",
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


def kind_allowed(kind: str, d: int, profile: Profile, ulysses_degree: int | None = None) -> bool:
    """Ulysses shards heads, so it needs num_heads % d == 0; ring attention works for any degree; a hybrid group's
    Ulysses degree u must divide the heads, and d / u >= 2."""
    if kind == ULYSSES:
        return profile.num_heads % d == 0
    if kind == RING:
        return True
    if kind == HYBRID:
        u = ulysses_degree
        return u is not None and u >= 2 and d % u == 0 and d // u >= 2 and profile.num_heads % u == 0
    raise ValueError(f"unknown attention kind {kind!r}; expected one of {GROUP_KINDS}")


def attention_square(s, profile: Profile) -> np.ndarray:
    """The ``s^2`` of the attention term (``a1 * s^2``) of sequences of ``s`` tokens on the profile's model: with a
    sliding window w on a share f of the layers, ``(1 - f) s^2 + f min(s^2, 2 s w - w^2)`` (module docstring)."""
    s = np.asarray(s, dtype=np.float64)
    w, f = profile.attention_window, profile.window_fraction
    if not w or not f:
        return s * s
    return (1.0 - f) * s * s + f * np.where(s <= w, s * s, 2.0 * s * w - float(w) * w)


def _ulysses_bytes_per_token(profile: Profile) -> float:
    # per layer and direction, all-to-alls of q and o (heads * head_dim each: the hidden size unless the model sets
    # its head size) and of k and v (h_kv * head_dim each); with h_kv == h this is FlexSP's 4 all-to-alls * 2
    # (fwd+bwd) * L * h * 2 bytes
    kv_dim = profile.num_kv_heads * profile.head_dim
    return 2 * profile.num_layers * (2 * profile.q_dim + 2 * kv_dim) * profile.bytes_per_element


def _ring_step_bytes_per_token(profile: Profile) -> float:
    kv_dim = profile.num_kv_heads * profile.head_dim
    return 3 * 2 * kv_dim * profile.bytes_per_element * profile.num_layers


def comm_bytes(s: int, d: int, kind: str, profile: Profile, ulysses_degree: int | None = None) -> float:
    """Bytes one device sends for a sequence of s tokens on a group of d (0 for d == 1)."""
    if d == 1:
        return 0.0
    if kind == ULYSSES:
        return _ulysses_bytes_per_token(profile) * s / d
    if kind == HYBRID:
        r = d // _u(d, ulysses_degree)
        return (_ulysses_bytes_per_token(profile) + (r - 1) * _ring_step_bytes_per_token(profile)) * s / d
    return (d - 1) * _ring_step_bytes_per_token(profile) * s / d


def _u(d: int, ulysses_degree: int | None) -> int:
    if ulysses_degree is None or ulysses_degree < 2 or d % ulysses_degree or d // ulysses_degree < 2:
        raise ValueError(f"a hybrid group of degree {d} needs a ulysses_degree u with u | d, d / u >= 2; got "
                         f"{ulysses_degree!r}")  # fmt: skip
    return ulysses_degree


def hybrid_seq_times_ms(
    lengths, d: int, u: int, profile: Profile, *, spans: bool = True, ulysses_spans: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(time, exposed communication) in ms of each sequence alone on a hybrid group: Ulysses over u consecutive
    ranks (one ring position, inside a node), zigzag ring over r = d / u positions (across nodes).

    Derivation (docs/design.md §2.1's Ulysses and ring terms, USP arXiv 2405.07719 §3): a sequence of s tokens is cut
    into r ring shards of s/r tokens (zigzag, so causal work balances); ring position j holds shard j on its u
    devices, s/d tokens each.

    * compute: every device does 1/d of the work, (a1*s^2 + a2*s)/d, as in a 1-D group of d.
    * Ulysses: inside position j the 4 all-to-alls per layer and direction (q, k, v, o) turn ``(s/d, h, hd)`` into
      ``(s/r, h/u, hd)`` and back: the 1-D Ulysses volume of a group of u over s/r tokens, bytes(s/r) / u per
      device, so ``t_a2a = bytes_per_token * (s/r) / (u * bw_a2a[u]) = bytes_per_token * s / (d * bw_a2a[u])``
      with the intra-node figure of degree u (inter where the position itself spans nodes: ``ulysses_spans``).
    * ring: after the all-to-all each device holds its position's s/r tokens for h/u heads; the r positions pass
      K/V (``h_kv*hd/u`` per token per device) round the ring, r - 1 exchanges per layer forward, K/V + dK/dV
      backward (the 1-D ring's 3x), so one ring step moves ``ring_bytes_per_token * (s/r) / u =
      ring_bytes_per_token * s/d`` per device -- the 1-D ring's step volume at degree d -- over the inter-node
      point-to-point figure of degree r (``spans``). One step's attention block is ``(s/r)^2`` tokens for h/u heads,
      ``c = a1*s^2 / (r^2 * u) = a1*s^2 / (d*r)``, overlapped with the exchange as the 1-D ring is:
      ``attention = c + (r - 1) * max(c, m)`` (first block local; r*c = a1*s^2/d).

    (GQA with h_kv < u replicates K/V heads for the all-to-all; the ring still moves h_kv*hd/u per token per device
    on average, what is priced.)
    """
    s = np.asarray(lengths, dtype=np.float64)
    r = d // _u(d, u)
    attn = profile.a1_ms * attention_square(s, profile)
    bw_a = profile.bandwidth_gbps(u, inter=ulysses_spans) * 1e9
    a2a = _ulysses_bytes_per_token(profile) * s / (d * bw_a) * 1e3
    bw_p = profile.bandwidth_gbps(r, ring=True, inter=spans) * 1e9
    c = attn / (d * r)
    m = _ring_step_bytes_per_token(profile) * (s / d) / bw_p * 1e3
    ring = c + (r - 1) * np.maximum(c, m)
    return ring + profile.a2_ms * s / d + a2a, a2a + (r - 1) * np.maximum(m - c, 0.0)


def seq_times_ms(
    lengths: np.ndarray,
    d: int,
    kind: str,
    profile: Profile,
    *,
    spans: bool = False,
    ulysses_degree: int | None = None,
    ulysses_spans: bool = False,
) -> np.ndarray:
    """Vectorised time (ms) of each sequence in `lengths` alone on a group of degree d with `kind` attention.

    ``spans``: the group's ranks span nodes (its collectives priced with the profile's inter-node tables); a hybrid
    group names ``ulysses_degree`` and whether a ring position itself spans nodes (``ulysses_spans``)."""
    s = np.asarray(lengths, dtype=np.float64)
    attn = profile.a1_ms * attention_square(s, profile)
    linear = profile.a2_ms * s
    if d == 1:
        return attn + linear
    if kind == ULYSSES:
        bw = profile.bandwidth_gbps(d, inter=spans) * 1e9  # bytes/s
        comm = _ulysses_bytes_per_token(profile) * s / (d * bw) * 1e3
        return (attn + linear) / d + comm
    if kind == RING:
        bw = profile.bandwidth_gbps(d, ring=True, inter=spans) * 1e9
        c = attn / (d * d)
        m = _ring_step_bytes_per_token(profile) * (s / d) / bw * 1e3
        return c + (d - 1) * np.maximum(c, m) + linear / d
    if kind == HYBRID:
        return hybrid_seq_times_ms(s, d, ulysses_degree, profile, spans=spans, ulysses_spans=ulysses_spans)[0]
    raise ValueError(f"unknown attention kind {kind!r}; expected one of {GROUP_KINDS}")


def seq_time_ms(s: int, d: int, kind: str, profile: Profile, **placement) -> float:
    """Time (ms) of one sequence of s tokens on a group of degree d (``placement``: as :func:`seq_times_ms`)."""
    return float(seq_times_ms(np.array([s]), d, kind, profile, **placement)[0])


def group_overhead_ms(
    d: int,
    kind: str,
    profile: Profile,
    *,
    spans: bool = False,
    ulysses_degree: int | None = None,
    ulysses_spans: bool = False,
) -> float:
    """Fixed cost (ms) of one group of degree d with `kind` attention per micro-batch: b1 + collective latency.

    b1 is FlexSP's per-group overhead (§4.1.2); the latency term (0 for d == 1) is flexorch's extension, measured
    per docs/design.md §7: all the collectives of one micro-batch cost at least this much, however few tokens they move.
    ``spans``: inter-node latency tables. A hybrid group pays its Ulysses all-to-alls' latency at degree u and its
    ring's at degree r = d / u.
    """
    if kind == HYBRID:
        u = _u(d, ulysses_degree)
        return (
            profile.b1_ms
            + profile.latency_ms(u, inter=ulysses_spans)
            + profile.latency_ms(d // u, ring=True, inter=spans)
        )
    if kind not in KINDS:
        raise ValueError(f"unknown attention kind {kind!r}; expected one of {GROUP_KINDS}")
    return profile.b1_ms + profile.latency_ms(d, ring=kind == RING, inter=spans)


def group_time_ms(lengths, d: int, kind: str, profile: Profile, **placement) -> float:
    """Overhead (b1 + latency) + the summed sequence times: one group's time in one micro-batch (0 when empty).
    ``placement``: ``spans``, ``ulysses_degree``, ``ulysses_spans`` (:func:`seq_times_ms`)."""
    if len(lengths) == 0:
        return 0.0
    seqs = seq_times_ms(np.asarray(lengths), d, kind, profile, **placement)
    return group_overhead_ms(d, kind, profile, **placement) + float(seqs.sum())


def group_comm_ms(
    lengths,
    d: int,
    kind: str,
    profile: Profile,
    *,
    spans: bool = False,
    ulysses_degree: int | None = None,
    ulysses_spans: bool = False,
) -> float:
    """The communication part of :func:`group_time_ms`: collective latency plus the all-to-all time (Ulysses) or
    the ring's exposed transfer time, what ``max(c, m)`` adds over compute (0 for d == 1 or an empty group)."""
    if d == 1 or len(lengths) == 0:
        return 0.0
    s = np.asarray(lengths, dtype=np.float64)
    if kind == HYBRID:
        u = _u(d, ulysses_degree)
        latency = profile.latency_ms(u, inter=ulysses_spans) + profile.latency_ms(d // u, ring=True, inter=spans)
        return latency + float(hybrid_seq_times_ms(s, d, ulysses_degree, profile, spans=spans,
                                                   ulysses_spans=ulysses_spans)[1].sum())  # fmt: skip
    latency = profile.latency_ms(d, ring=kind == RING, inter=spans)
    if kind == ULYSSES:
        bw = profile.bandwidth_gbps(d, inter=spans) * 1e9
        moved = float((_ulysses_bytes_per_token(profile) * s / (d * bw) * 1e3).sum())
    else:
        bw = profile.bandwidth_gbps(d, ring=True, inter=spans) * 1e9
        c = profile.a1_ms * attention_square(s, profile) / (d * d)
        m = _ring_step_bytes_per_token(profile) * (s / d) / bw * 1e3
        moved = float(((d - 1) * np.maximum(m - c, 0.0)).sum())
    return latency + moved
