"""The planner the driver talks to (run in-process here): never worse than the best static layout, clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from flexorch.solver.planner import PlannerConfig
from flexorch.solver.simulator import step_time_ms
from flexorch.solver.step_planner import StepPlanner, planner_profile
from tests.solver_helpers import TINY

PROFILE = planner_profile(
    TINY.with_overrides(
        hidden=64, act_bytes_per_token=2560.0, a2a_latency_ms={2: 5.0, 4: 9.0}, p2p_latency_ms={2: 4.0, 4: 8.0}
    ),  # 20 bf16 hidden vectors per token
    num_heads=4,
    num_kv_heads=2,
    tokens_per_worker=128,
)


@pytest.mark.parametrize("seed", range(4))
def test_adaptive_plan_is_never_predicted_slower_than_batchada(seed):
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(3.5, 1.2, size=40).astype(int), 2, 512).tolist()
    planner = StepPlanner(PROFILE, PlannerConfig(time_limit_s=0.01, ilp_time_limit_s=0.01))
    out = planner.plan(lengths, 4)
    assert out.plan is not None and out.error is None
    assert out.predicted_ms == pytest.approx(step_time_ms(out.plan, PROFILE))
    assert out.predicted_ms <= out.baselines_ms["batchada"] + 1e-9
    assert out.bound_ms <= out.predicted_ms + 1e-9


def test_static_mode_and_infeasible_batches():
    ring2 = StepPlanner(PROFILE, PlannerConfig(), static=("ring", 2)).plan([10, 200, 40, 256], 4)
    assert {g.degree for mb in ring2.plan.micro_batches for g in mb.groups} == {2} and ring2.status == "static-ring-2"
    one = StepPlanner(PROFILE, PlannerConfig(), static=("ulysses", 1)).plan([10, 200], 4)
    assert one.plan is None and "cannot run this batch" in one.error and one.status == "infeasible"
    too_long = StepPlanner(PROFILE, PlannerConfig()).plan([10, 600], 4)
    assert too_long.plan is None and "600 tokens" in too_long.error
