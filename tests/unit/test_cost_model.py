"""The cost model against hand-computed FlexSP formulas (docs/design.md §2.1) with the published 7B constants, and the
per-degree collective latency flexorch adds."""

import pytest

from flexorch.solver import get_profile, min_degree, seq_time_ms
from flexorch.solver.cost_model import comm_bytes, group_overhead_ms, group_time_ms, kind_allowed, next_pow2

P = get_profile("gpt-7b-a100")


def test_compute_terms_and_ulysses_all_to_all():
    s = 8192
    compute = 5.128e-6 * s * s + 0.18396 * s
    assert seq_time_ms(s, 1, "ulysses", P) == pytest.approx(compute)
    assert seq_time_ms(s, 1, "ring", P) == pytest.approx(compute)
    # d=8 inside a node: bytes(s) = 4 a2a * 2 (fwd+bwd) * L * h * s * 2 B, over d * 96.5 GB/s
    comm_ms = 4 * 2 * 32 * 4096 * s * 2 / (8 * 96.5e9) * 1e3
    assert seq_time_ms(s, 8, "ulysses", P) == pytest.approx(compute / 8 + comm_ms)
    # across nodes the bandwidth collapses (10.33 GB/s at 16): the device-time almost doubles
    assert 16 * seq_time_ms(2000, 16, "ulysses", P) > 1.8 * 8 * seq_time_ms(2000, 8, "ulysses", P)


def test_ring_overlaps_block_compute_with_kv_exchange():
    s, d = 65536, 4
    attn = 5.128e-6 * s * s
    c = attn / (d * d)
    step_bytes = 3 * 2 * (32 * 128) * 2 * 32 * (s / d)
    m = step_bytes / (104.07e9) * 1e3
    expected = c + (d - 1) * max(c, m) + 0.18396 * s / d
    assert seq_time_ms(s, d, "ring", P) == pytest.approx(expected)


def test_gqa_shrinks_communication():
    gqa = P.with_overrides(num_kv_heads=8)
    assert comm_bytes(1000, 4, "ulysses", gqa) == pytest.approx(comm_bytes(1000, 4, "ulysses", P) * (2 + 2 / 4) / 4)
    assert comm_bytes(1000, 4, "ring", gqa) == pytest.approx(comm_bytes(1000, 4, "ring", P) / 4)
    assert comm_bytes(1000, 1, "ring", P) == 0.0


def test_memory_and_degrees():
    assert P.tokens_per_device == 6250  # 28 GB / 4.48 MB
    assert [next_pow2(x) for x in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]
    assert min_degree(6250, 6250) == 1 and min_degree(6251, 6250) == 2 and min_degree(384 * 1024, 6250) == 64
    assert kind_allowed("ulysses", 32, P) and not kind_allowed("ulysses", 64, P) and kind_allowed("ring", 64, P)
    with pytest.raises(ValueError, match="unknown attention kind"):
        kind_allowed("star", 2, P)


# per-degree collective latency (flexorch's extension, docs/design.md §7): a fixed cost per group per micro-batch
LAT = P.with_overrides(a2a_latency_ms={2: 7.0, 8: 20.0}, p2p_latency_ms={4: 3.0})


def test_group_time_includes_b1_and_collective_latency_once():
    seqs = [1000, 3000]
    compute = sum(seq_time_ms(s, 2, "ulysses", P) for s in seqs)
    assert group_time_ms(seqs, 2, "ulysses", LAT) == pytest.approx(P.b1_ms + 7.0 + compute)
    assert group_time_ms(seqs, 2, "ulysses", P) == pytest.approx(P.b1_ms + compute)  # built-in profiles: none
    assert group_time_ms(seqs, 1, "ulysses", LAT) == pytest.approx(group_time_ms(seqs, 1, "ulysses", P))
    assert group_time_ms([], 8, "ring", LAT) == 0.0
    # sequence times do not change: the latency is per group, not per sequence
    assert seq_time_ms(1000, 2, "ulysses", LAT) == seq_time_ms(1000, 2, "ulysses", P)


def test_latency_lookup_takes_the_next_larger_measured_degree():
    assert [group_overhead_ms(d, "ulysses", LAT) - P.b1_ms for d in (1, 2, 4, 8, 16, 32)] == pytest.approx(
        [0.0, 7.0, 20.0, 20.0, 20.0, 20.0]  # 4 -> 8's; beyond the table: the largest measured degree
    )
    assert [LAT.latency_ms(d, ring=True) for d in (1, 2, 4, 64)] == [0.0, 3.0, 3.0, 3.0]
    only_a2a = P.with_overrides(a2a_latency_ms={2: 1.5})
    assert group_overhead_ms(2, "ring", only_a2a) == pytest.approx(P.b1_ms + 1.5)  # ring falls back to a2a
    with pytest.raises(ValueError, match="unknown attention kind"):
        group_overhead_ms(2, "star", LAT)


def test_comm_part_is_what_sp_adds_over_compute_and_bounds_the_share():
    from flexorch.solver.cost_model import group_comm_ms
    from flexorch.solver.plan import Group, MicroBatch, Plan
    from flexorch.solver.simulator import comm_share, step_time_ms

    s, d = 8192, 8
    compute = 5.128e-6 * s * s + 0.18396 * s
    # Ulysses: the group time is b1 + its compute share + exactly the communication part
    assert group_time_ms([s], d, "ulysses", P) == pytest.approx(
        P.b1_ms + compute / d + group_comm_ms([s], d, "ulysses", P)
    )
    assert group_comm_ms([s], 1, "ulysses", P) == 0.0 and group_comm_ms([], d, "ring", P) == 0.0
    # ring with compute-bound blocks (long sequence): only the collective latency is exposed
    assert group_comm_ms([65536], 4, "ring", P) == pytest.approx(P.latency_ms(4, ring=True))
    plan = Plan.for_profile(
        num_devices=8,
        seq_lengths=[s, 512],
        micro_batches=[MicroBatch((Group(d, "ulysses", tuple(range(8)), (0, 1)),))],
        profile=P,
    )
    share = comm_share(plan, P)
    assert share == pytest.approx(group_comm_ms([s, 512], d, "ulysses", P) / step_time_ms(plan, P))
    assert 0 < share < 1


def test_a_sliding_window_prices_a_windowed_layers_attention_by_its_band():
    from flexorch.solver.cost_model import attention_square

    w = 1024
    all_local = P.with_overrides(attention_window=w, window_fraction=1.0)
    gemma = P.with_overrides(attention_window=w, window_fraction=5 / 6)
    s = [512, 1024, 4096, 32768]
    # within the window a windowed layer is a full one; beyond it, the band: w^2/2 + (s - w) w pairs, doubled
    assert list(attention_square(s, all_local)) == [512.0**2, 1024.0**2, 2 * 4096 * w - w * w, 2 * 32768 * w - w * w]
    assert list(attention_square(s, P)) == [float(x) * x for x in s]
    mixed = attention_square(s, gemma)
    assert mixed == pytest.approx(
        [(x * x + 5 * float(a)) / 6 for x, a in zip(s, attention_square(s, all_local), strict=True)]
    )
    # a 32K document with a 1K window on 5 of 6 layers: about a fifth of the quadratic attention
    assert 0.19 < mixed[-1] / 32768**2 < 0.23
    # every a1 term takes it: one device, Ulysses, ring (its exchange unchanged), hybrid
    linear = 0.18396 * 32768
    assert seq_time_ms(32768, 1, "ulysses", gemma) == pytest.approx(5.128e-6 * mixed[-1] + linear)
    assert seq_time_ms(32768, 8, "ulysses", gemma) < seq_time_ms(32768, 8, "ulysses", P)
    assert seq_time_ms(32768, 4, "ring", gemma) < seq_time_ms(32768, 4, "ring", P)
    assert comm_bytes(32768, 4, "ring", gemma) == comm_bytes(32768, 4, "ring", P)
    hybrid = {"ulysses_degree": 2}
    assert seq_time_ms(32768, 8, "hybrid", gemma, **hybrid) < seq_time_ms(32768, 8, "hybrid", P, **hybrid)
    # short documents never reach the window: priced as before
    assert seq_time_ms(800, 2, "ulysses", gemma) == pytest.approx(seq_time_ms(800, 2, "ulysses", P))


def test_a_head_size_other_than_hidden_over_heads_moves_the_all_to_all_volume():
    wide = P.with_overrides(head_size=256)  # 32 heads of 256 on a hidden size of 4096: q and o twice as wide
    q_dim, kv_dim = 32 * 256, 32 * 256
    per_token = 2 * 32 * (2 * q_dim + 2 * kv_dim) * 2
    assert comm_bytes(8192, 8, "ulysses", wide) == pytest.approx(per_token * 8192 / 8)
    assert comm_bytes(8192, 8, "ulysses", wide) == pytest.approx(2 * comm_bytes(8192, 8, "ulysses", P))


@pytest.mark.parametrize(
    "changes,match",
    [({"attention_window": -1}, "attention_window must be an integer >= 0"),
     ({"attention_window": 1024}, "window_fraction must be in \\(0, 1\\] with an attention_window"),
     ({"window_fraction": 0.5}, "0 without"),
     ({"attention_window": 1024, "window_fraction": 1.5}, "window_fraction"),
     ({"head_size": -8}, "head_size must be an integer >= 0")],
)  # fmt: skip
def test_bad_window_and_head_size_fields_are_refused(changes, match):
    from flexorch.solver import ProfileError

    with pytest.raises(ProfileError, match=match):
        P.with_overrides(**changes)
