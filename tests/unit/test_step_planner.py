"""The planner the driver talks to (run in-process here): never worse than the best static layout, clear errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flexorch.records.writer import plan_fields
from flexorch.solver.errors import InvalidPlanError
from flexorch.solver.pipeline.staged import StagedPlan, plan_staged
from flexorch.solver.planned_step import HEURISTIC, OUT_OF_TIME, PlannedStep
from flexorch.solver.planner import PlannerConfig
from flexorch.solver.profiles import get_profile
from flexorch.solver.simulator import step_time_ms
from flexorch.solver.step_planner import StepPlanner, heuristic_plan, planner_profile
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


# ---- the one solve result, and the staged plan it may hold, check themselves with the numbers in the message


def _sp_planned():
    with StepPlanner(PROFILE, PlannerConfig(time_limit_s=0.2)) as planner:
        return planner.plan([10, 200, 40, 256, 30], 4)


@pytest.mark.parametrize(
    "change, msg",
    [
        ({"predicted_ms": -1.0}, "PlannedStep.predicted_ms must be a finite number >= 0, got -1.0"),
        ({"predicted_ms": float("nan")}, "PlannedStep.predicted_ms must be a finite number >= 0, got nan"),
        ({"solve_s": float("inf")}, "PlannedStep.solve_s must be a finite number >= 0, got inf"),
        ({"bound_ms": -0.5}, "PlannedStep.bound_ms must be a finite number >= 0, got -0.5"),
        ({"predicted_ms": 3.0, "bound_ms": 7.5}, "the lower bound 7.5 ms exceeds the predicted step time 3.0 ms"),
        ({"status": ""}, "PlannedStep.status must name how the plan was found, got ''"),
        ({"baselines_ms": {"batchada": -2.0}}, "PlannedStep.baselines_ms['batchada'] must be None or a finite"),
        ({"error": "too long"}, "exactly one of a plan and an error, got plan=True and error='too long'"),
        ({"plan": None}, "exactly one of a plan and an error, got plan=False and error=None"),
    ],
)
def test_planned_step_refuses_an_impossible_result(change, msg):
    good = _sp_planned()
    with pytest.raises(ValueError) as e:
        dataclasses.replace(good, **change)
    assert msg in str(e.value)


def test_planned_step_says_whether_it_is_pipelined():
    sp = _sp_planned()
    assert sp.plan is not None and not sp.pipelined
    with pytest.raises(TypeError, match="must be a Plan, a StagedPlan or None, got list"):
        dataclasses.replace(sp, plan=[1, 2])
    with StepPlanner(get_profile("gpt-7b-a100"), PlannerConfig(time_limit_s=0.2), pipeline_stages=2) as planner:
        pp = planner.plan(PIPE_LENGTHS, 4)
    assert pp.pipelined and isinstance(pp.plan, StagedPlan) and pp.status.startswith("pipeline")
    assert pp.predicted_ms == pytest.approx(pp.plan.makespan_ms, rel=1e-12)
    failed = planner.plan([10**7], 4)
    assert failed.plan is None and not failed.pipelined and failed.status == "infeasible"


PIPE_LENGTHS = [3000, 500, 8000, 1200]


def test_staged_plan_refuses_a_shape_the_ranks_cannot_hold():
    staged = plan_staged(PIPE_LENGTHS, 4, get_profile("gpt-7b-a100"), 2, time_limit_s=0.2)
    assert (staged.stages, staged.degree, staged.layers) == (2, 2, (16, 16))
    cases = [
        ({"degree": 0}, "staged plan: degree must be an integer >= 1, got 0"),
        ({"degree": 3}, "staged plan: 2 stages of 3 ranks need 6 ranks, the world has 4"),
        ({"num_devices": 3}, "staged plan: 2 stages of 2 ranks need 4 ranks, the world has 3"),
        ({"layers": (32,)}, "staged plan: layers (32,) must be 2 counts >= 1, one per stage"),
        ({"layers": (32, 0)}, "staged plan: layers (32, 0) must be 2 counts >= 1, one per stage"),
        ({"plan": dataclasses.replace(staged.plan, pipelines=())}, "the pipeline plan holds no pipeline"),
    ]
    pipe = staged.plan.pipelines[0]
    n = len(pipe.units)
    over = dataclasses.replace(pipe, checkpointed=(pipe.checkpointed[0], (17,) * n))
    cases.append(
        (
            {"plan": dataclasses.replace(staged.plan, pipelines=(over,))},
            f"pipeline 0, stage 1: checkpointed {(17,) * n} must be {n} counts in 0..16 (its layers), one per unit",
        )
    )
    short = dataclasses.replace(pipe, checkpointed=pipe.checkpointed[:1])
    cases.append(
        (
            {"plan": dataclasses.replace(staged.plan, pipelines=(short,))},
            "pipeline 0 has 2 op lists and 1 checkpointing rows for 2 stages",
        )
    )
    for change, msg in cases:
        with pytest.raises(InvalidPlanError) as e:
            dataclasses.replace(staged, **change)
        assert msg in str(e.value), change


def test_the_two_fallbacks_share_their_status_and_differ_by_heuristic():
    """The planner out of time and the client's MILP-free plan both write status 'fallback' into the records (as
    they always have); ``PlannedStep.heuristic`` tells them apart, and is not written."""
    client = heuristic_plan(PROFILE, [10, 20, 150, 5], 4, None)
    assert client.status == HEURISTIC == "fallback" and client.heuristic and not client.out_of_time
    late = PlannedStep(client.plan, client.predicted_ms, status=OUT_OF_TIME)
    assert late.out_of_time and not late.heuristic and late.kind == "sp" and not late.pipelined
    a, b = plan_fields(client, PROFILE), plan_fields(late, PROFILE)
    assert a["status"] == b["status"] == "fallback" and "heuristic" not in a
    assert {k: v for k, v in a.items() if k != "gap"} == {k: v for k, v in b.items() if k != "gap"}
