"""The planner against brute-force enumeration of every plan on tiny instances, and the bound's validity."""

import numpy as np
import pytest

from solver import PlannerConfig, plan_step, step_time_ms
from solver.bounds import area_and_min_time, step_bound_ms
from solver.packing import group_types, time_table
from tests.solver_helpers import TINY, brute_force_optimum


def _instances(count, seed):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n = int(rng.choice([1, 2, 4, 8]))
        k = int(rng.integers(1, 7))
        # lengths from a few tokens to what all N devices hold, skewed short like real corpora
        top = n * TINY.tokens_per_device
        lengths = np.minimum(top, np.ceil(rng.pareto(1.2, k) * 25 + 1)).astype(int)
        yield n, lengths


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_planner_matches_brute_force_and_bound_is_valid(seed):
    exact_checked = 0
    for n, lengths in _instances(12, seed):
        best, best_single = brute_force_optimum(lengths, n, TINY)
        res = plan_step(lengths, n, TINY, PlannerConfig(time_limit_s=5.0))
        got = step_time_ms(res.plan, TINY)
        assert got == pytest.approx(res.makespan_ms, rel=1e-9)
        assert got >= best * (1 - 1e-9), "a plan beat the brute-force optimum: simulator and brute force disagree"
        assert res.bound_ms <= best * (1 + 1e-9), f"bound {res.bound_ms} above the optimum {best} for {lengths}"
        if best_single == best:  # one micro-batch is optimal: the planner must find the optimum
            assert got == pytest.approx(best, rel=1e-6), (n, lengths.tolist(), got, best)
            exact_checked += 1
    assert exact_checked >= 6  # the test really compared optima


def test_bound_below_brute_force_on_memory_bound_instances():
    # batches that cannot run in one micro-batch: the bound must stay below the optimum
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(15):
        n = int(rng.choice([2, 4]))
        lengths = rng.integers(n * 40, n * 100, size=int(rng.integers(3, 6)))
        best, single = brute_force_optimum(lengths, n, TINY)
        types = group_types(n, TINY)
        table = time_table(lengths, types, TINY)
        bound = step_bound_ms(table, types, lengths, n, TINY.tokens_per_device, TINY.b1_ms)
        assert bound <= best * (1 + 1e-9)
        res = plan_step(lengths, n, TINY)
        assert res.makespan_ms >= best * (1 - 1e-9)
        checked += single > best
    assert checked >= 3  # some instances really needed several micro-batches


def test_area_and_min_time_pick_the_cheapest_feasible_type():
    types = group_types(8, TINY)
    table = time_table(np.array([50, 350]), types, TINY)
    area, tmin = area_and_min_time(table, types)
    degrees = np.array([t.degree for t in types])
    assert area[0] == pytest.approx(table[0, 0])  # a short sequence is cheapest on one device
    assert tmin[1] == pytest.approx(np.nanmin(np.where(degrees >= 4, table[1], np.inf)))
