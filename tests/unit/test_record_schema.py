"""The step record schema, flexorch.step/4: real records validate, and each kind of damage gets a message naming it."""

from __future__ import annotations

import copy
import io
import json

import pytest

from flexorch.cli.plan import PlanRunConfig, run_plan
from flexorch.records.schema import SCHEMA, RecordError, validate_record
from flexorch.records.writer import StepRecords, read_records, skip_record
from flexorch.solver.planner import PlannerConfig
from flexorch.solver.profiles import get_profile


@pytest.fixture(scope="module")
def plan_records():
    cfg = PlanRunConfig(workers=8, batch=24, steps=2, json=True, planner=PlannerConfig(time_limit_s=0.3))
    return run_plan(cfg, get_profile("gpt-7b-a100"), out=io.StringIO())


def test_plan_records_validate(plan_records):
    for r in plan_records:
        assert validate_record(r) is r
        assert r["schema"] == SCHEMA and r["source"] == "plan" and not r["skipped"]


def _broken(rec, change):
    rec = copy.deepcopy(rec)
    change(rec)
    return rec


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r.pop("predicted_ms"), "key 'predicted_ms' is missing"),
        (lambda r: r.update(step="3"), "'step' is str '3', expected integer"),
        (lambda r: r.update(solve_s=None), "'solve_s' is null, expected"),
        (lambda r: r.update(skipped="no"), "'skipped' is str"),
        (lambda r: r.update(schema="flexorch.step/2"), "written by an older flexorch"),
        (lambda r: r.update(schema="something"), "schema is 'something'"),
        (lambda r: r.update(source="bench"), "source is 'bench'"),
        (
            lambda r: r["plan"]["micro_batches"][0][0].update(ranks=[99] * r["plan"]["micro_batches"][0][0]["degree"]),
            "ranks [99",
        ),
        (lambda r: r["plan"]["micro_batches"][0][0].pop("kind"), "plan.micro_batches[0][0] lacks kind"),
        (lambda r: r["plan"]["micro_batches"][0][0]["seq_ids"].pop(), "every sequence of the batch exactly once"),
        (lambda r: r["plan"].update(num_devices=3), "plan.num_devices 3 differs from world_size 8"),
        (lambda r: r["timeline"].pop(), "one entry per group"),
        (lambda r: r.update(timeline=None), "'timeline' is null but the record has a plan"),
        (lambda r: r.update(skipped=True), "a skipped step has no plan"),
        (lambda r: r.update(predicted_ms=float("nan")), "expected a finite number"),
        # 'auto' recompute: one mode per group of the plan
        (lambda r: r.update(recompute=[["none"]]), "'recompute' must be null or one mode (none, selective, full)"),
        (lambda r: r.update(recompute=[["fast"] * len(mb) for mb in r["plan"]["micro_batches"]]), "got [['fast'"),
    ],
)
def test_damage_is_named(plan_records, change, message):
    with pytest.raises(RecordError, match="^step 0: ") as e:
        validate_record(_broken(plan_records[0], change), "step 0")
    assert message in str(e.value)


def test_a_mode_per_group_validates(plan_records):
    rec = copy.deepcopy(plan_records[0])
    modes = ("none", "selective", "full")
    rec["recompute"] = [[modes[gi % 3] for gi in range(len(mb))] for mb in rec["plan"]["micro_batches"]]
    assert validate_record(rec) is rec


def test_train_keys_are_required_for_train_records(plan_records):
    rec = dict(plan_records[0], source="train")
    with pytest.raises(RecordError, match="key 'batch_index' is missing"):
        validate_record(rec)


def test_skipped_train_record_validates():
    base = {
        "step": 4,
        "epoch": 0,
        "batch_index": 4,
        "doc_ids": [7, 9],
        "seq_lengths": [10, 5000],
        "world_size": 2,
        "worker_ids": [0, 1],
        "mode": "adaptive",
        "solve_s": 0.01,
        "plan_wait_ms": 0.0,
        "baselines_ms": {},
        "recoveries": [],
    }
    rec = {"schema": SCHEMA, "time": 1.0, **skip_record(base, "infeasible", "the longest sequence needs 3 workers")}
    assert validate_record(rec)["tokens"] == 9 + 4999
    for bad in (-1, 9 + 4999 + 1):  # loss targets: at most the positions the step predicted at
        with pytest.raises(RecordError, match="'targets' must be an integer in 0..tokens"):
            validate_record({**rec, "targets": bad})
    for bad in (2.5, True):
        with pytest.raises(RecordError, match=rf"'targets' is \w+ {bad}, expected integer"):
            validate_record({**rec, "targets": bad})
    assert validate_record({**rec, "targets": 120})["targets"] == 120
    rec["doc_ids"] = [7]
    with pytest.raises(RecordError, match="doc_ids and seq_lengths differ"):
        validate_record(rec)


def test_writer_refuses_a_bad_record_and_reader_names_the_line(tmp_path, plan_records):
    w = StepRecords(tmp_path)
    w.append({k: v for k, v in plan_records[0].items() if k not in ("schema", "time")})
    with pytest.raises(RecordError, match="key 'plan' is missing"):
        w.append({k: v for k, v in plan_records[1].items() if k != "plan"})
    assert len(read_records(w.path, validate=True)) == 1  # nothing half-written
    with w.path.open("a") as f:
        f.write(json.dumps({**plan_records[1], "world_size": -1}) + "\n")
    with pytest.raises(RecordError, match=r"steps\.jsonl:2: plan\.num_devices 8 differs from world_size -1"):
        read_records(w.path, validate=True)
    with w.path.open("a") as f:
        f.write("{not json\n")
    with pytest.raises(RecordError, match=r"steps\.jsonl:3: not a JSON record"):
        read_records(w.path)


@pytest.fixture(scope="module")
def pipeline_records():
    from tests.pipeline_helpers import pipeline_plan_records, train_record_from_plan

    plans = pipeline_plan_records()
    return plans[0], train_record_from_plan(plans[0])


def test_pipeline_records_validate(pipeline_records):
    plan_rec, train_rec = pipeline_records
    for r in (plan_rec, train_rec):
        assert validate_record(r) is r and r["plan"] is None and r["pipeline"] is not None


@pytest.mark.parametrize(
    "which, change, message",
    [
        ("plan", lambda r: r["pipeline"].pop("ops"), "pipeline lacks ops"),
        ("plan", lambda r: r["pipeline"]["ops"].pop(), "one F and one B per unit and stage"),
        ("plan", lambda r: r["pipeline"].update(degree=64), "must be positive and fit world_size 8"),
        ("plan", lambda r: r["pipeline"]["stage_ranks"][0].__setitem__(0, 7), "stages of 2 distinct ranks"),
        ("plan", lambda r: r["pipeline"]["units"][0]["pieces"].pop(), "cover every token of sequence"),
        (
            "plan",
            lambda r: r["pipeline"]["units"].__setitem__(0, [1, 2]),
            "'pipeline.units[0]' is list [1, 2], expected an object",
        ),
        ("plan", lambda r: r["pipeline"]["checkpointed"][0].pop(), "one entry per unit"),
        ("plan", lambda r: r.update(plan={"num_devices": 8, "micro_batches": []}), "one of 'plan' or 'pipeline'"),
        ("train", lambda r: r["ranks"][0]["ops"].pop(), "ranks[0].ops must hold its stage's"),
        (
            "train",
            lambda r: r["ranks"][0]["ops"][0].update(kind="X"),
            "'ranks[0].ops[0].kind' is 'X', expected 'F' or 'B'",
        ),
        ("train", lambda r: r["ranks"][0]["ops"][1].update(r["ranks"][0]["ops"][0]), "each (kind, unit) once"),
        ("train", lambda r: r["ranks"][0]["ops"][0].update(start_ms=1e9), "start_ms <= end_ms"),
        (
            "train",
            lambda r: r["ranks"][0]["ops"][0].update(wait_ms=-1.0),
            "'ranks[0].ops[0].wait_ms' must be >= 0, got -1.0",
        ),
    ],
)
def test_pipeline_damage_is_named(pipeline_records, which, change, message):
    rec = pipeline_records[0] if which == "plan" else pipeline_records[1]
    with pytest.raises(RecordError) as e:
        validate_record(_broken(rec, change), "step 0")
    assert message in str(e.value)


def test_measured_bubble_share_is_the_time_stage_ranks_spent_outside_their_ops(pipeline_records):
    from flexorch.records.writer import measured_bubble_share

    plan_rec, train_rec = pipeline_records
    assert measured_bubble_share(plan_rec) is None  # nothing measured
    # rank 0 busy 0-10 and 20-30, rank 1 busy 5-25; rank 2 lost, rank 3 in no stage: 1 - 40 / (2 * 30)
    ops = [
        [{"kind": "F", "unit": 0, "start_ms": 0.0, "end_ms": 10.0}, {"kind": "B", "unit": 0, "start_ms": 20.0,
         "end_ms": 30.0, "wait_ms": 10.0}],
        [{"kind": "F", "unit": 0, "start_ms": 5.0, "end_ms": 25.0, "wait_ms": 5.0}],
    ]  # fmt: skip
    rec = {**train_rec, "ranks": [{"ops": ops[0]}, {"ops": ops[1]}, None, {"ops": []}]}
    assert measured_bubble_share(rec) == pytest.approx(1 / 3)
    assert measured_bubble_share({**rec, "pipeline": None}) is None  # an SP step
    assert 0.0 <= measured_bubble_share(train_rec) < 1.0


def test_the_json_schema_describes_every_key(plan_records):
    from flexorch.records.schema import record_json_schema

    schema = record_json_schema()
    assert set(plan_records[0]) <= set(schema["properties"])  # every key a plan record has is documented
    undocumented = [
        f"{name}.{key}"
        for name, obj in [("record", schema), *schema["$defs"].items()]
        for key, prop in obj["properties"].items()
        if "description" not in prop and "$ref" not in prop
    ]
    assert len(undocumented) <= 8, undocumented  # a few self-explaining names (stage, kind, end_ms, ...) only


def test_recompute_packing_names_a_priced_packing(plan_records):
    rec = {**plan_records[0], "recompute_packing": {"packing": "none", "full_ms": 12.0, "none_ms": 10.0}}
    assert validate_record(rec) is rec
    with pytest.raises(RecordError, match="the packing that ran, 'selective', needs a number in 'selective_ms'"):
        validate_record({**rec, "recompute_packing": {"packing": "selective", "full_ms": 12.0, "selective_ms": None}})
    with pytest.raises(RecordError, match=r"'recompute_packing.packing' is 'fast', expected 'full', 'none' or"):
        validate_record({**rec, "recompute_packing": {"packing": "fast", "full_ms": 12.0}})
