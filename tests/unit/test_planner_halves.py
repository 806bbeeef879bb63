"""Issue 48 ("never behind FlexSP's solver"): the tallest sequences on the groups they really run on (one group of
all N devices, or two of N/2 side by side each running a share: ``solver.halves``), the per-degree chain fronts
(``solver.round_bounds``), squeezed tiered splits and the count bound (``solver.count_bounds``)."""

from __future__ import annotations

import numpy as np
import pytest

from flexorch.solver import PlannerConfig, count_bounds, plan_step, step_time_ms
from flexorch.solver.bounds import area_and_min_time, step_bound_ms
from flexorch.solver.halves import light_fill, plan_rounds, split_halves, tier_devices
from flexorch.solver.microbatching import tiered_split
from flexorch.solver.packing import Draft, group_types, layout_groups, time_table, type_caps, type_overheads
from flexorch.solver.plan import Group, MicroBatch, Plan
from flexorch.solver.profiles import get_profile
from flexorch.solver.round_bounds import round_fronts, slowest_fronts
from tests.solver_helpers import TINY, TINY_PROFILES, brute_force_optimum

FLEXSP_7B = get_profile("gpt-7b-a100").with_overrides(num_heads=64, num_kv_heads=64)  # Ulysses up to 64
"""FlexSP's GPT-7B setting (its cost model's constants; 64 heads: Ulysses on all 64 devices)."""
TINY8 = TINY.with_overrides(name="tiny8", hidden=8, num_heads=8, num_kv_heads=8)
"""TINY with 8 heads: Ulysses groups of 8 too, whose all-to-all is slower per device than a group of 4's."""


def _setup(lengths, n, profile):
    types = group_types(n, profile)
    table = time_table(lengths, types, profile)
    return types, table, type_caps(types, profile), type_overheads(types, profile)


def _type(types, degree, kind):
    return next(i for i, t in enumerate(types) if t.degree == degree and t.kind == kind)


def _priced(drafts, types, lengths, n, profile) -> float:
    mbs = [MicroBatch(tuple(layout_groups(d, types, range(len(lengths))))) for d in drafts]
    plan = Plan.for_profile(num_devices=n, seq_lengths=lengths, micro_batches=mbs, profile=profile)
    return step_time_ms(plan, profile)


def test_split_halves_runs_a_full_group_as_two_half_groups_where_that_is_faster():
    # ten ~34K-token sequences one after another on one Ulysses group of all 64 devices (what a memory-tight
    # micro-batch's packers chose on code lengths) against two groups of 32 side by side, five each: the 64-device
    # all-to-all is slower per device (4.87 against 5.94 GB/s), so the halves win by ~8 %
    lengths = np.array([35767, 35100, 35002, 34597, 34564, 34252, 34113, 33858, 33370, 33081])
    n = 64
    types, table, caps, overheads = _setup(lengths, n, FLEXSP_7B)
    u64 = _type(types, 64, "ulysses")
    one = Draft([u64], [list(range(10))], np.array([overheads[u64] + table[:, u64].sum()]), np.array([lengths.sum()]))
    before = _priced([one], types, lengths, n, FLEXSP_7B)
    assert split_halves([one], types, table, lengths, caps, overheads) == 1
    after = _priced([one], types, lengths, n, FLEXSP_7B)
    assert after < 0.95 * before
    assert after == pytest.approx(one.makespan(), rel=1e-9)  # the draft's loads are the simulator's
    assert sorted(types[t].degree for t in one.group_type) == [32, 32]
    assert sorted(i for m in one.members for i in m) == list(range(10))
    for t, m, load in zip(one.group_type, one.members, one.loads, strict=True):
        assert lengths[m].sum() <= caps[t]
        assert load == pytest.approx(overheads[t] + table[m, t].sum(), rel=1e-12)
    # one sequence alone is not split, nor a group whose halves would be slower (a 118K-token sequence runs
    # twice as long on 32 devices as on 64: the short ones beside it gain less than that costs)
    tall = np.array([118_000] + [300] * 20)
    types, table, caps, overheads = _setup(tall, n, FLEXSP_7B)
    u64 = _type(types, 64, "ulysses")
    keep = Draft([u64], [list(range(tall.size))], np.array([overheads[u64] + table[:, u64].sum()]), np.array([0]))
    assert split_halves([keep], types, table, tall, caps, overheads) == 0
    assert keep.group_type == [u64] and len(keep.members) == 1


def test_planner_runs_two_tall_sequences_side_by_side_on_half_groups_at_the_optimum():
    # two sequences that each need half of 8 devices' memory: one group of 8 runs them one after another, two groups
    # of 4 side by side (the shorter ones with them); the brute force over every plan agrees the halves are optimal
    lengths, n = np.array([330, 320, 20, 15]), 8
    types, table, _, overheads = _setup(lengths, n, TINY8)
    u8 = _type(types, 8, "ulysses")
    one_group = Plan.for_profile(
        num_devices=n,
        seq_lengths=lengths,
        micro_batches=[MicroBatch((Group(8, "ulysses", tuple(range(8)), (0, 1, 2, 3)),))],
        profile=TINY8,
    )
    assert step_time_ms(one_group, TINY8) == pytest.approx(overheads[u8] + table[:, u8].sum())
    best, _ = brute_force_optimum(lengths, n, TINY8)
    res = plan_step(lengths, n, TINY8, PlannerConfig(time_limit_s=2.0, isolate=False))
    assert res.predicted_ms == pytest.approx(step_time_ms(res.plan, TINY8), rel=1e-12)
    assert res.predicted_ms == pytest.approx(best, rel=1e-9)
    assert res.predicted_ms < 0.8 * step_time_ms(one_group, TINY8)
    (mb,) = res.plan.micro_batches
    tall = [g for g in mb.groups if {0, 1} & set(g.seq_ids)]
    assert [g.degree for g in tall] == [4, 4]  # side by side, one each
    assert res.bound_ms <= best * (1 + 1e-9)


def test_round_fronts_take_each_chain_on_the_degree_it_runs_on():
    # two sequences of 230 and 220 tokens need 4 of 8 devices each; without the time table a chain lasts its
    # members' least time on its least degree (the old relaxation: the 8-group's speed on 4 devices); with it, on 4
    # devices it takes the 4-group's time, and one group of 8 runs both one after another
    lengths, n = np.array([230, 220]), 8
    types, table, _, _ = _setup(lengths, n, TINY8)
    deg = np.array([t.degree for t in types], dtype=np.float64)
    finite = np.isfinite(table)
    w = table.min(axis=1)
    old = round_fronts(w, lengths, finite, deg, n, TINY8.tokens_per_device)
    new = round_fronts(w, lengths, finite, deg, n, TINY8.tokens_per_device, table)
    t4 = np.where(deg == 4, table, np.inf).min(axis=1)
    t8 = np.where(deg == 8, table, np.inf).min(axis=1)
    assert old[0b11] == [(8.0, pytest.approx(w.max()))]  # both side by side on 4 devices each, at their least times
    assert new[0b11][-1][1] == pytest.approx(min(t4.max(), t8.sum()))  # side by side on halves, or one after another
    assert new[0b11][-1][1] > w.max() * 1.05
    for mask in range(1, 4):  # never below the relaxation: the bounds built on them stay valid and get tighter
        assert new[mask][-1][1] >= old[mask][-1][1] - 1e-9 and new[mask][0][0] >= old[mask][0][0]


def test_the_slowest_take_the_degree_they_run_on_in_tiers_and_seeds():
    # FlexSP's GPT-7B setting: a 118K-token sequence needs 32 devices' memory but runs twice as fast on 64 (2.25 s
    # against 4.2 s); with 32 heads (ring only on 64 devices, 25 s) a 79K one runs fastest on 32 (memory needs 16)
    n = 64
    for profile, tall, want in ((FLEXSP_7B, 118_000, 64), (get_profile("gpt-7b-a100"), 79_000, 32)):
        rng = np.random.default_rng(0)
        lengths = np.array([tall] + rng.integers(100, 4000, 300).tolist())
        types, table, _, _ = _setup(lengths, n, profile)
        deg = np.array([t.degree for t in types], dtype=np.float64)
        need = deg[np.argmax(np.isfinite(table), axis=1)].astype(np.int64)
        assert need[0] == want // 2
        few, fronts = slowest_fronts(table, deg, lengths, n, profile.tokens_per_device)
        g = light_fill(table, deg, lengths, few, n, profile.tokens_per_device)
        assert tier_devices(need, few, fronts, g, n)[0] == want
        assert (tier_devices(need, few, fronts, g, n)[1:] == need[1:]).all()
        seeds = plan_rounds(few, fronts, g, n)
        (members, devices, span), *_ = seeds[0]
        assert members == [0] and devices == want
        assert span == pytest.approx(np.where(deg == want, table[0], np.inf).min())


def test_squeezed_tiered_split_keeps_the_fewest_micro_batches():
    # one sequence that runs fastest on all 64 devices, and short ones that one more micro-batch would hold: the
    # plain tiered split gives it a micro-batch of its own and the rest two more; squeezed, the short ones the rest
    # cannot hold share its micro-batch (the fewest memory allows: 2)
    n, profile = 64, FLEXSP_7B
    rng = np.random.default_rng(0)
    lengths = np.array([126_000] + rng.integers(50, 3000, 300).tolist())
    lengths[1:] = (lengths[1:] * 420_000 / lengths[1:].sum()).astype(np.int64)
    types, table, _, _ = _setup(lengths, n, profile)
    area, wall = area_and_min_time(table, types)
    cap = n * profile.tokens_per_device
    need = np.full(lengths.size, 1)
    need[0] = 64
    plain = tiered_split(lengths, area, wall, need, n, capacity_tokens=cap, ratio=1.0)
    squeezed = tiered_split(lengths, area, wall, need, n, capacity_tokens=cap, ratio=1.0, squeeze=True)
    assert len(plain) == 3 and len(squeezed) == 2
    assert sorted(i for c in squeezed for i in c) == list(range(lengths.size))
    assert all(lengths[c].sum() <= 0.95 * cap for c in squeezed)
    tall = next(c for c in squeezed if 0 in c)
    assert len(tall) > 1 and max(lengths[i] for i in tall if i != 0) <= np.sort(lengths[1:])[len(tall)]  # shortest
    # nothing to squeeze: None (the plain split is the same)
    few = lengths[: lengths.size // 2]
    assert tiered_split(few, area[: few.size], wall[: few.size], need[: few.size], n, capacity_tokens=cap,
                        ratio=1.0, squeeze=True) is None  # fmt: skip


@pytest.mark.slow  # two whole planner solves with real budgets: about 4 s on 2 cores
def test_planner_shares_the_all_device_group_instead_of_a_micro_batch_more():
    # FlexSP's GPT-7B setting: a 126K-token sequence runs fastest on all 64 devices (no one beside it), and the 420K
    # tokens of short ones need one micro-batch more than the other holds. Measured 5,646 ms without the new search
    # (one group of 64 with few short ones) and 5,266 ms with it (4.9 % above the bound), at 1 s and at 4 s alike
    rng = np.random.default_rng(0)
    short = []
    while sum(short) < 420_000:
        short.append(int(rng.integers(50, 3000)))
    lengths = np.array([126_000] + short)
    old = plan_step(lengths, 64, FLEXSP_7B, PlannerConfig(time_limit_s=4.0, isolate=False, halves=False))
    new = plan_step(lengths, 64, FLEXSP_7B, PlannerConfig(time_limit_s=4.0, isolate=False))
    assert new.bound_ms == pytest.approx(old.bound_ms)
    assert new.predicted_ms == pytest.approx(step_time_ms(new.plan, FLEXSP_7B), rel=1e-9)
    assert new.predicted_ms < 0.97 * old.predicted_ms
    assert new.predicted_ms < 1.08 * new.bound_ms
    assert len(new.plan.micro_batches) == 2


@pytest.mark.parametrize("seed", range(2))
def test_count_bound_is_valid_and_binds(seed, monkeypatch):
    """One or two sequences that need 40-90 % of the devices' memory and short ones: the bound with the count bound
    (one more micro-batch pays its fixed cost; the fewest run short ones on the slowest ones' groups) stays below
    the brute-force optimum, and is above the bound without it on some (it is not a term that never binds)."""
    rng = np.random.default_rng(200 + seed)
    above = checked = 0
    for it in range(40):
        profile = list(TINY_PROFILES.values())[it % len(TINY_PROFILES)]
        n = int(rng.choice([4, 8]))
        big = rng.integers(int(n * 100 * 0.4), int(n * 100 * 0.9), int(rng.integers(1, 3)))
        lengths = np.concatenate([big, rng.integers(3, 100, int(rng.integers(1, 4)))]).astype(int)
        types, table, _, overheads = _setup(lengths, n, profile)
        if not np.isfinite(table).any(axis=1).all():
            continue
        bound = step_bound_ms(table, types, lengths, n, profile.tokens_per_device, overheads)
        with monkeypatch.context() as m:
            m.setattr(count_bounds, "COUNT_K", 0)  # no sequence placed: the bound before it
            before = step_bound_ms(table, types, lengths, n, profile.tokens_per_device, overheads)
        best, _ = brute_force_optimum(lengths, n, profile)
        assert before <= bound <= best * (1 + 1e-9), (profile.name, n, lengths.tolist(), before, bound, best)
        above += bound > before * (1 + 1e-6)
        checked += 1
    assert checked >= 30 and above >= 3
