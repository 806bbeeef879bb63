"""`pipeline_stages`: the config refuses what cannot run (saying what to change), the per-step planner maps the
workers alive onto stages, never plans slower than its baselines, and has a MILP-free fallback."""

from __future__ import annotations

import pytest

from flexorch.cli.main import main
from flexorch.config import ConfigError, TrainConfig, config_from_dict
from flexorch.solver.errors import InfeasibleBatchError
from flexorch.solver.pipeline.schedule import check_schedule
from flexorch.solver.pipeline.staged import fallback_staged, plan_staged
from flexorch.solver.planner import PlannerConfig
from flexorch.solver.profiles import Profile
from flexorch.solver.step_planner import StepPlanner, heuristic_plan

LENGTHS = [256, 12, 90, 31, 200, 7, 150, 64]


def _profile(**kw) -> Profile:
    values = {
        "name": "pp-test",
        "a1_ms": 2e-5,
        "a2_ms": 0.02,
        "b1_ms": 1.0,
        "act_bytes_per_token": 11_000.0,
        "memory_budget_bytes": 11_000.0 * 64,
        "model_state_bytes": 0.0,
        "num_layers": 4,
        "hidden": 64,
        "num_heads": 4,
        "num_kv_heads": 2,
        "a2a_gbps": {2: 1.0, 4: 1.0},
        "bytes_per_element": 4,
        **kw,
    }
    return Profile(**values)


@pytest.mark.parametrize(
    "values,message",
    [
        ({"pipeline_stages": 5}, "the model has 4 layers: every stage needs at least one layer; use at most 4"),
        ({"pipeline_stages": 0}, "pipeline_stages must be a positive integer or 'auto', got 0"),
        ({"pipeline_stages": "two"}, "pipeline_stages must be a positive integer or 'auto', got 'two'"),
        ({"pipeline_stages": 4, "workers": 3}, "pipeline_stages = 4 needs at least 4 workers, the run has 3"),
        ({"pipeline_stages": 1, "workers": 3, "model": {"num_heads": 4}}, None),
        (
            {"pipeline_stages": 2, "workers": 6, "model": {"num_heads": 4, "num_kv_heads": 2}},
            "puts 3 workers on a stage (Ulysses inside the stage), which must divide model.num_heads=4",
        ),
        (
            {"pipeline_stages": 2, "plan": {"mode": "static-ulysses-2"}},
            "cannot be combined with pipeline_stages = 2 (set plan.mode = 'adaptive')",
        ),
        ({"pipeline_stages": 2, "min_workers": 1}, "min_workers=1 is too few: pipeline_stages = 2 needs 2 workers"),
    ],
)
def test_config_refuses_what_cannot_run(values, message):
    base = {"workers": 4, "model": {"num_layers": 4}, "data": {"max_context": 2048}}
    for k, v in values.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    if message is None:
        assert isinstance(config_from_dict(base), TrainConfig)
        return
    with pytest.raises(ConfigError) as e:
        config_from_dict(base)
    assert message in str(e.value)


def test_pipeline_lifts_the_single_group_context_limit():
    # 2048-token documents do not fit one SP group of 4 x 64 tokens, but a pipeline splits them into segments
    cfg = config_from_dict(
        {"workers": 4, "pipeline_stages": 2, "model": {"num_layers": 4}, "data": {"max_context": 2048},
         "plan": {"tokens_per_worker": 64}}
    )  # fmt: skip
    assert cfg.pipelined and cfg.min_workers == 2
    with pytest.raises(ConfigError, match="data.max_context=2048 tokens cannot fit"):
        TrainConfig(**{**cfg.__dict__, "pipeline_stages": 1, "min_workers": None})


def test_cli_flag_parses_numbers_and_auto(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--pipeline-stages", "many"])
    assert e.value.code == 2
    assert "expected a number of stages or 'auto', got 'many'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "n,stages,want", [(4, 2, ((0, 1), (2, 3))), (3, 2, ((0,), (1,))), (5, 4, ((0,), (1,), (2,), (3,)))]
)
def test_stages_map_the_workers_alive(n, stages, want):
    staged = plan_staged(LENGTHS, n, _profile(), stages, time_limit_s=0.5)
    assert staged.stage_ranks == want and staged.num_devices == n
    assert sum(staged.layers) == 4 and len(staged.layers) == stages
    for pipe in staged.plan.pipelines:
        check_schedule([list(ops) for ops in pipe.schedule], list(pipe.units))
    covered = sorted((p.seq, p.start, p.end) for u in staged.plan.units for p in u.pieces)
    for i, s in enumerate(LENGTHS):  # every token of every sequence exactly once
        mine = [(a, b) for q, a, b in covered if q == i]
        assert mine[0][0] == 0 and mine[-1][1] == s and all(x[1] == y[0] for x, y in zip(mine, mine[1:], strict=False))
    d = staged.to_dict()
    assert d["stage_ranks"] == [list(r) for r in want] and len(d["ops"]) == 2 * stages * len(d["units"])


def test_stage_mapping_errors_say_what_to_do():
    with pytest.raises(InfeasibleBatchError, match="pipeline_stages = 4 needs at least 4 workers, 3 are alive"):
        plan_staged(LENGTHS, 3, _profile(), 4)
    with pytest.raises(InfeasibleBatchError, match="no activation checkpointing fits the memory budget"):
        plan_staged([4000], 2, _profile(), 2)


def test_planner_never_slower_than_its_baselines_and_fallback_needs_no_milp():
    planner = StepPlanner(_profile(), PlannerConfig(time_limit_s=0.5), pipeline_stages=2)
    out = planner.plan(LENGTHS, 4)
    assert out.plan is not None and out.status.startswith("pipeline")
    assert set(out.baselines_ms) == {"1f1b", "seq1f1b-4"}
    assert out.predicted_ms <= min(v for v in out.baselines_ms.values() if v is not None) + 1e-9
    bad = planner.plan([4000], 4)
    assert bad.plan is None and "no activation checkpointing fits" in bad.error
    fb = fallback_staged(LENGTHS, 4, _profile(), 2)
    assert all(c == fb.layers[r] for pipe in fb.plan.pipelines for r, cs in enumerate(pipe.checkpointed) for c in cs)
    h = heuristic_plan(_profile(), LENGTHS, 4, None, pipeline_stages="auto")
    assert h.status == "fallback" and h.plan.stages == 2
    assert fb.makespan_ms >= out.predicted_ms - 1e-9  # recomputing everything is never faster


def test_planner_profile_takes_the_stage_bytes_measured_on_the_workers():
    from flexorch.solver.step_planner import planner_profile

    base = _profile()
    p = planner_profile(base, num_heads=4, num_kv_heads=2, tokens_per_worker=100, num_layers=4, stage_bytes=(2000, 900))
    assert p.act_bytes_per_token == 4 * 2000 + 900 and p.head_bytes_per_token == 900
    # the budget is in those bytes, for the costliest layout: a Ulysses stage of 4 (each of the 4 layers keeps
    # the all-to-all'd attention output, 64 floats, and 2 more K/V heads of 16 floats each, replicated up to 4)
    costliest = 4 * 2000 + 900 + 4 * (64 + 2 * 2 * 16) * 4
    assert p.memory_budget_bytes == pytest.approx(100.5 * costliest)
    q = planner_profile(base, num_heads=4, num_kv_heads=2, tokens_per_worker=100, vocab_size=257)
    assert q.act_bytes_per_token == base.act_bytes_per_token
    assert q.head_bytes_per_token == 4 * 257 + 4 * base.hidden * base.bytes_per_element  # the analytic estimate
