"""`[pipeline] stages`: the config refuses what cannot run (saying what to change, by the one stage-count rule the
plan command and the per-step planner apply too), the per-step planner maps the workers alive onto stages, never
plans slower than its baselines, and has a MILP-free fallback."""

from __future__ import annotations

import dataclasses

import pytest

from flexorch.cli.main import main
from flexorch.config import ConfigError, PipelineSettings, TrainConfig, config_from_dict
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
        (
            {"pipeline": {"stages": 5}},
            "pipeline.stages = 5 is more stages than the model's 4 layers: every stage needs at least one layer; use "
            "at most 4",
        ),
        ({"pipeline": {"stages": 0}}, "pipeline.stages must be a positive integer or 'auto', got 0"),
        ({"pipeline": {"stages": "two"}}, "pipeline.stages must be a positive integer or 'auto', got 'two'"),
        ({"pipeline": {"params": "mine"}}, "pipeline.params must be 'stage' or 'replicated', got 'mine'"),
        ({"pipeline": {"stages": 4}, "workers": 3}, "pipeline.stages = 4 needs at least 4 workers, the run has 3"),
        ({"pipeline": {"stages": 1}, "workers": 3, "model": {"num_heads": 4}}, None),
        (
            {"pipeline": {"stages": 2}, "workers": 6, "model": {"num_heads": 4, "num_kv_heads": 2}},
            "pipeline.stages = 2 on 6 workers puts 3 workers on each stage (Ulysses SP inside a stage), but the "
            "model's 4 heads are not divisible by 3",
        ),
        (  # 'auto' needs one power-of-two split whose workers per stage divide the heads: 6 // 2 = 3 does not, and
            # 4 stages would need 4 layers
            {"pipeline": {"stages": "auto"}, "workers": 6, "model": {"num_layers": 2}},
            "pipeline.stages = 'auto': no split of 6 workers into 2 to 2 stages",
        ),
        ({"pipeline": {"stages": "auto"}, "workers": 6}, None),  # 4 stages of 1 worker on the 4 layers
        (
            {"pipeline": {"stages": 2}, "plan": {"mode": "static-ulysses-2"}},
            "cannot be combined with pipeline.stages = 2 (set plan.mode = 'adaptive')",
        ),
        (
            {"pipeline": {"stages": 2}, "elastic": {"min_workers": 1}},
            "elastic.min_workers=1 is too few: pipeline.stages = 2 needs 2 workers",
        ),
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
        {"workers": 4, "pipeline": {"stages": 2}, "model": {"num_layers": 4}, "data": {"max_context": 2048},
         "plan": {"tokens_per_worker": 64}}
    )  # fmt: skip
    assert cfg.pipelined and cfg.min_workers == 2
    with pytest.raises(ConfigError, match="data.max_context=2048 tokens cannot fit"):
        dataclasses.replace(cfg, pipeline=PipelineSettings(stages=1))
    assert isinstance(cfg.replace(pipeline=PipelineSettings(stages=4)), TrainConfig)


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


@pytest.mark.parametrize("stages", [2, 3, 4, 8, "auto"])
def test_one_stage_count_rule_for_the_config_and_the_per_step_planner(stages):
    """The config and the staged planner refuse exactly what ``check_stage_count`` refuses, with its message."""
    from flexorch.solver.pipeline.stage_count import check_stage_count

    refused = 0
    for workers in range(1, 7):
        for layers in (1, 2, 4):
            for heads in (2, 4):
                try:
                    check_stage_count(
                        stages, workers, layers, heads, key="pipeline.stages", have=f"the run has {workers}"
                    )
                    want = None
                except ValueError as e:
                    want = str(e)
                values = {
                    "workers": workers,
                    "pipeline": {"stages": stages},
                    "model": {"num_layers": layers, "num_heads": heads},
                    "data": {"max_context": 64},
                    "plan": {"tokens_per_worker": 64},
                }
                if want is None:
                    assert config_from_dict(values).pipeline.stages == stages
                    continue
                refused += 1
                with pytest.raises(ConfigError) as e:
                    config_from_dict(values)
                assert str(e.value) == want
                with pytest.raises(InfeasibleBatchError) as e:
                    plan_staged(LENGTHS, workers, _profile(num_layers=layers, num_heads=heads), stages)
                alive = want.replace(f"the run has {workers}", f"{workers} are alive")
                assert str(e.value) == alive.replace("pipeline.stages", "pipeline_stages")
    assert refused > 0
