"""The planner stops where its answer is proven within the tolerance of optimal (``PlannerConfig.stop_at_bound``).

Issue 48: on the demo's batches the first start of every micro-batch was already at its lower bound, yet the planner
spent its whole budget solving them, on the cores the workers' step ran on. These pin that such a batch is planned
without a MILP solve and to the same step time, that the split search ends once the step's bound is reached, and that
a batch short of its bounds is still solved. The saving is measured in ``benchmarks/sim/planner_stop.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from flexorch.data.lengths import bundled_lengths_path, read_lengths
from flexorch.solver.bounds import micro_batch_bound_ms
from flexorch.solver.cost_model import group_time_ms
from flexorch.solver.planner import Planner, PlannerConfig
from flexorch.solver.profiles import get_profile
from flexorch.solver.step_tables import step_tables

PROFILE = get_profile("gpt-7b-a100")
TPD = PROFILE.tokens_per_device


class _Solves:
    """Counts the MILP solve jobs a planner makes (its probe seam)."""

    def __init__(self):
        self.jobs = 0

    def at(self, point, key):
        self.jobs += point == "solve"


def _plan(lengths, n: int, stop: bool):
    solves = _Solves()
    config = PlannerConfig(time_limit_s=2.0, isolate=False, stop_at_bound=stop)
    with Planner(PROFILE, config) as planner:
        planner.add_probe(solves)
        return planner.plan(np.asarray(lengths), n), solves.jobs


def test_a_batch_at_its_micro_batch_bounds_is_planned_without_a_solve():
    # the demo's shape: every sequence needs two devices, two groups of two per micro-batch on 4 devices
    lengths = [int(TPD * 1.5)] * 16
    stopped, jobs = _plan(lengths, 4, stop=True)
    full, full_jobs = _plan(lengths, 4, stop=False)
    assert jobs == 0 and full_jobs > 0
    assert set(stopped.details["methods"]) == {"bound"}
    assert stopped.predicted_ms == pytest.approx(full.predicted_ms, rel=1e-9)
    # each micro-batch kept is within the tolerance of its proven bound, so no solve could have beaten it by more
    step = step_tables(np.asarray(lengths), 4, PROFILE, PlannerConfig())
    for mb in stopped.plan.micro_batches:
        ids = [i for g in mb.groups for i in g.seq_ids]
        makespan = max(group_time_ms([lengths[i] for i in g.seq_ids], g.degree, g.kind, PROFILE) for g in mb.groups)
        bound = micro_batch_bound_ms(step.table[ids], step.deg, step.n, step.overheads)
        assert makespan <= bound * (1 + PlannerConfig().tolerance) + 1e-9


def test_the_split_search_ends_at_the_step_bound():
    lengths = [int(TPD * 0.8)] * 7 + [int(TPD * 3)]
    stopped, _ = _plan(lengths, 4, stop=True)
    full, _ = _plan(lengths, 4, stop=False)
    assert stopped.predicted_ms <= stopped.bound_ms * (1 + PlannerConfig().tolerance) + 1e-9
    assert stopped.details["candidates_solved"] == 1 < full.details["candidates_solved"]
    assert stopped.predicted_ms == pytest.approx(full.predicted_ms, rel=PlannerConfig().tolerance)


def test_a_batch_short_of_its_bounds_is_still_solved():
    data = read_lengths(bundled_lengths_path())
    data = data[(data > 0) & (data <= 16 * TPD)]
    lengths = np.random.default_rng(3).choice(data, size=64)
    stopped, jobs = _plan(lengths, 16, stop=True)
    assert stopped.predicted_ms > stopped.bound_ms * (1 + PlannerConfig().tolerance)  # what this test is about
    full, _ = _plan(lengths, 16, stop=False)
    assert jobs > 0 and stopped.details["candidates_solved"] == full.details["candidates_solved"]
