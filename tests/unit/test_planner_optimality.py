"""The planner against brute-force enumeration of every plan on tiny instances, and the bound's validity, with and
without per-degree collective latency."""

import numpy as np
import pytest

from flexorch.solver import PlannerConfig, min_degree, plan_step, step_time_ms
from flexorch.solver.bounds import area_and_min_time, step_bound_ms
from flexorch.solver.packing import group_types, time_table, type_overheads
from tests.solver_helpers import TINY, TINY_LATENCY, TINY_PROFILES, brute_force_optimum


def _instances(count, seed):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n = int(rng.choice([1, 2, 4, 8]))
        k = int(rng.integers(1, 7))
        # lengths from a few tokens to what all N devices hold, skewed short like real corpora
        top = n * TINY.tokens_per_device
        lengths = np.minimum(top, np.ceil(rng.pareto(1.2, k) * 25 + 1)).astype(int)
        yield n, lengths


@pytest.mark.parametrize("latency", list(TINY_PROFILES))
@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in (1, 2))])
def test_planner_matches_brute_force_and_bound_is_valid(seed, latency):
    profile = TINY_PROFILES[latency]
    exact_checked = 0
    for n, lengths in _instances(12, seed):
        best, best_single = brute_force_optimum(lengths, n, profile)
        res = plan_step(lengths, n, profile, PlannerConfig(time_limit_s=5.0))
        got = step_time_ms(res.plan, profile)
        assert got == pytest.approx(res.predicted_ms, rel=1e-9)
        assert got >= best * (1 - 1e-9), "a plan beat the brute-force optimum: simulator and brute force disagree"
        assert res.bound_ms <= best * (1 + 1e-9), f"bound {res.bound_ms} above the optimum {best} for {lengths}"
        if best_single == best:  # one micro-batch is optimal: the planner must find the optimum
            assert got == pytest.approx(best, rel=1e-6), (n, lengths.tolist(), got, best)
            exact_checked += 1
    assert exact_checked >= 6  # the test really compared optima


@pytest.mark.parametrize("latency", list(TINY_PROFILES))
def test_bound_below_brute_force_on_memory_bound_instances(latency):
    # batches that cannot run in one micro-batch: the bound must stay below the optimum
    profile = TINY_PROFILES[latency]
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(15):
        n = int(rng.choice([2, 4]))
        lengths = rng.integers(n * 40, n * 100, size=int(rng.integers(3, 6)))
        best, single = brute_force_optimum(lengths, n, profile)
        types = group_types(n, profile)
        table = time_table(lengths, types, profile)
        bound = step_bound_ms(table, types, lengths, n, profile.tokens_per_device, type_overheads(types, profile))
        assert bound <= best * (1 + 1e-9)
        res = plan_step(lengths, n, profile)
        assert res.predicted_ms >= best * (1 - 1e-9)
        checked += single > best
    assert checked >= 3  # some instances really needed several micro-batches


def test_area_and_min_time_pick_the_cheapest_feasible_type():
    types = group_types(8, TINY)
    table = time_table(np.array([50, 350]), types, TINY)
    area, tmin = area_and_min_time(table, types)
    degrees = np.array([t.degree for t in types])
    assert area[0] == pytest.approx(table[0, 0])  # a short sequence is cheapest on one device
    assert tmin[1] == pytest.approx(np.nanmin(np.where(degrees >= 4, table[1], np.inf)))
    # with latency, the least wall time includes a type's fixed cost above b1 (single devices pay b1 alone)
    lat = TINY_LATENCY["large"]
    overheads = type_overheads(types, lat)
    assert overheads[0] == lat.b1_ms and (overheads[1:] > lat.b1_ms).all()
    _, tmin_lat = area_and_min_time(time_table(np.array([350]), types, lat), types, overheads)
    assert tmin_lat[0] == pytest.approx(np.min(np.where(degrees >= 4, table[1] + overheads - lat.b1_ms, np.inf)))


def _groups(plan, lengths):
    return [(g.degree, [int(lengths[i]) for i in g.seq_ids]) for mb in plan.micro_batches for g in mb.groups]


def test_latency_keeps_short_sequences_on_single_devices():
    # every sequence fits one device. Blind to latency, SP over short sequences looks nearly free and the planner
    # uses it; with gloo-like latency the optimum is single devices, and the latency-blind plan is much slower
    lengths, n = np.array([90, 70, 50, 30, 20, 10]), 4
    lat = TINY_LATENCY["large"]
    blind = plan_step(lengths, n, TINY)
    assert any(d > 1 for d, _ in _groups(blind.plan, lengths))
    res = plan_step(lengths, n, lat)
    assert all(d == 1 for d, _ in _groups(res.plan, lengths)), _groups(res.plan, lengths)
    best, _ = brute_force_optimum(lengths, n, lat)
    assert res.predicted_ms == pytest.approx(best, rel=1e-9)
    assert res.predicted_ms == pytest.approx(step_time_ms(res.plan, lat), rel=1e-12)
    assert step_time_ms(blind.plan, lat) > 1.5 * res.predicted_ms


def test_latency_still_uses_sp_where_memory_forces_it():
    # 300 tokens need 3 devices' memory (a group of 4); the 100-token sequences fit one device each
    lengths, n = np.array([300, 100, 100, 100, 100]), 4
    lat = TINY_LATENCY["large"]
    res = plan_step(lengths, n, lat)
    groups = _groups(res.plan, lengths)
    assert any(d == 4 and 300 in ls for d, ls in groups), groups
    for d, ls in groups:  # an SP group only where some sequence in it needs the memory
        assert d == 1 or max(min_degree(s, lat.tokens_per_device) for s in ls) > 1, groups
    assert sum(len(ls) for d, ls in groups if d == 1) == 4  # the short ones all run on single devices
    best, _ = brute_force_optimum(lengths, n, lat)
    assert res.predicted_ms == pytest.approx(best, rel=1e-9)
    assert res.predicted_ms == pytest.approx(step_time_ms(res.plan, lat), rel=1e-12)
    assert res.bound_ms <= res.predicted_ms
