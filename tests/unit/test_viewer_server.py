"""The plan viewer's data and HTTP server, without a browser: real records, a real server on loopback, urllib."""

from __future__ import annotations

import io
import json
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from flexorch.cli.main import main
from flexorch.cli.plan import PlanRunConfig, run_plan
from flexorch.cli.train_console import format_step
from flexorch.dashboards.plan_svg import task_colour
from flexorch.dashboards.viewer import ViewerServer
from flexorch.dashboards.viewer_data import rank_speeds, read_run, seq_tasks, step_view
from flexorch.records.schema import validate_record
from flexorch.records.writer import measured_bubble_share
from flexorch.solver.planner import PlannerConfig
from flexorch.solver.profiles import get_profile
from tests.paths import DATA
from tests.pipeline_helpers import (
    LATE_MS,
    RECORDED_PIPELINE,
    SLOW,
    measured_op,
    pipeline_plan_records,
    train_record_from_plan,
)

RECORDED = DATA / "recorded_run"


@pytest.fixture(scope="module")
def plan_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("plan-run")
    cfg = PlanRunConfig(workers=8, batch=24, steps=3, planner=PlannerConfig(time_limit_s=0.3), run_dir=run)
    run_plan(cfg, get_profile("gpt-7b-a100"), out=io.StringIO())
    return run


def test_recorded_train_run_views_have_measured_bars():
    data = read_run(RECORDED)
    assert data["error"] is None and data["total"] == len(data["records"]) >= 3
    for view in data["records"]:
        assert view["source"] == "train" and view["groups"]
        assert {g["micro_batch"] for g in view["groups"]} == set(range(view["micro_batches"]))
        for g in view["groups"]:
            assert g["measured_ms"] > 0 and g["measured_start_ms"] >= 0 and g["predicted_ms"] > 0
        # every rank appears once per micro-batch it takes part in
        ranks = sorted(r for g in view["groups"] for r in g["ranks"] if g["micro_batch"] == 0)
        assert ranks == sorted(set(ranks)) and max(ranks) < view["world_size"]
    assert read_run(RECORDED, since=2)["records"][0]["step"] == data["records"][2]["step"]


def test_measured_group_time_is_its_slowest_member():
    rec = json.loads((RECORDED / "steps.jsonl").read_text().splitlines()[0])
    view = step_view(rec)
    g = next(g for g in view["groups"] if g["degree"] > 1) if any(g["degree"] > 1 for g in view["groups"]) else None
    g = g or view["groups"][0]
    times = [rec["ranks"][r]["micro_batch_ms"][g["micro_batch"]] for r in g["ranks"]]
    assert g["measured_ms"] == max(times)


def test_the_view_names_each_ranks_node_where_the_ranks_lie_on_several():
    rec = json.loads((RECORDED / "steps.jsonl").read_text().splitlines()[0])
    assert step_view(rec)["nodes"] is None  # one node (a record from before nodes were recorded): no boundary
    n = rec["world_size"]
    rec["nodes"] = ["10.0.0.1"] * (n // 2) + ["10.0.0.2"] * (n - n // 2)
    assert step_view(rec)["nodes"] == rec["nodes"]
    del rec["nodes"]
    rec["plan"]["topology"] = {"node_sizes": [n - 1, 1]}  # a plan record: the plan's topology
    assert step_view(rec)["nodes"] == ["node 0"] * (n - 1) + ["node 1"]


SLOW_RANK, SLOW_SPEED = 2, 0.52
"""In :func:`slow_worker_run` worker 2 runs at about half the others' pace."""


def slow_worker_run(run_dir: Path) -> list[dict]:
    """The recorded run as a run with a slow worker records it: each rank's entry has the driver's estimate of its
    speed (rank 2 at 0.52x, the others about 1.0), its node and pid; from step 1 on the plan is priced with the
    planner's (snapped) speeds (``plan.topology.speeds``, rank 2 at 0.5x). Written to ``run_dir``, returned."""
    records = [json.loads(line) for line in (RECORDED / "steps.jsonl").read_text().splitlines()]
    for i, rec in enumerate(records):
        for r, entry in enumerate(rec["ranks"]):
            entry.update(speed=SLOW_SPEED if r == SLOW_RANK else (0.98, 1.0, 1.0, 1.03)[r], node=None, pid=4000 + r)
        if i:
            planned = [0.5 if r == SLOW_RANK else 1.0 for r in range(rec["world_size"])]
            rec["plan"]["topology"] = {"node_sizes": [rec["world_size"]], "speeds": planned}
        validate_record(rec)
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def test_the_view_gives_each_ranks_speed_and_the_slow_ones():
    rec = json.loads((RECORDED / "steps.jsonl").read_text().splitlines()[1])
    view = step_view(rec)  # a record without speeds: nothing to shade
    assert view["speeds"] is None and view["slow_ranks"] == [] and view["slow_below"] == 0.8
    assert all(g["speed"] is None for g in view["groups"])
    # a plan record priced with speeds: the plan's speeds (0.85x is not slow)
    planned = [1.0, 0.85, 0.5, 1.0]
    rec["plan"]["topology"] = {"node_sizes": [4], "speeds": planned}
    view = step_view(rec)
    assert view["speeds"] == planned and view["slow_ranks"] == [2]
    assert [g["speed"] for g in view["groups"]] == [
        min(planned[r] for r in g["ranks"]) for mb in rec["plan"]["micro_batches"] for g in mb
    ]
    # a trained record's per-rank estimate (what the worker showed) wins over the speed the plan assumed; a rank
    # without one (an older record, a lost rank's null entry) keeps the plan's
    rec["ranks"][0]["speed"] = 0.61
    rec["ranks"][2]["speed"] = 0.97
    rec["ranks"][3] = None
    assert rank_speeds(rec) == [0.61, 0.85, 0.97, 1.0]
    assert step_view(rec)["slow_ranks"] == [0]
    del rec["plan"]["topology"]
    rec["ranks"][0]["speed"] = "fast"  # not a number: as if not there
    assert rank_speeds(rec) == [1.0, 1.0, 0.97, 1.0]


def test_slow_workers_reach_the_page_json(tmp_path):
    records = slow_worker_run(tmp_path)
    server = ViewerServer(tmp_path, port=0).start()
    try:
        data = json.loads(_get(server.url + "api/steps")[2])
    finally:
        server.stop()
    assert data["error"] is None and data["total"] == len(records)
    for rec, view in zip(records, data["records"], strict=True):
        assert view["speeds"] == [e["speed"] for e in rec["ranks"]] and view["slow_ranks"] == [SLOW_RANK]
        for g in view["groups"]:
            assert g["speed"] == min(view["speeds"][r] for r in g["ranks"])


def test_malformed_line_keeps_the_good_records_and_names_it(tmp_path):
    lines = (RECORDED / "steps.jsonl").read_text().splitlines()
    bad = json.loads(lines[1])
    del bad["plan"]
    (tmp_path / "steps.jsonl").write_text("\n".join([lines[0], json.dumps(bad), lines[2]]) + "\n")
    data = read_run(tmp_path)
    assert data["total"] == 1 and len(data["records"]) == 1
    assert "steps.jsonl line 2: key 'plan' is missing" in data["error"]
    (tmp_path / "steps.jsonl").write_text(lines[0] + "\n{oops\n")
    assert "line 2: not JSON" in read_run(tmp_path)["error"]


def test_a_line_being_written_waits_then_counts_as_malformed(tmp_path):
    lines = (RECORDED / "steps.jsonl").read_text().splitlines()
    path = tmp_path / "steps.jsonl"
    path.write_text(lines[0] + "\n" + lines[1][:40])  # the writer is mid-line
    data = read_run(tmp_path)
    assert data["total"] == 1 and data["error"] is None
    old = time.time() - 60
    os.utime(path, (old, old))  # ... and it never finished the line
    assert "line 2: not JSON" in read_run(tmp_path)["error"]


def test_no_records_yet_is_waiting(tmp_path):
    assert read_run(tmp_path) == {"total": 0, "records": [], "error": None, "waiting": True}


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.headers.get("Content-Type"), r.read()


def test_server_serves_page_script_plotly_and_steps(plan_run):
    server = ViewerServer(plan_run, port=0).start()
    try:
        assert server.url.startswith("http://127.0.0.1:")
        status, ctype, body = _get(server.url)
        assert status == 200 and ctype.startswith("text/html") and b'id="plan-predicted"' in body
        assert b'src="/plotly.min.js"' in body and b'src="/viewer.js"' in body
        status, _, body = _get(server.url + "viewer.js")
        assert status == 200 and b"Plotly.react" in body
        status, _, body = _get(server.url + "plotly.min.js")
        assert status == 200 and len(body) > 1_000_000 and b"plotly" in body[:2000].lower()
        status, ctype, body = _get(server.url + "api/steps?since=1")
        data = json.loads(body)
        assert ctype == "application/json" and data["total"] == 3 and [r["step"] for r in data["records"]] == [1, 2]
        assert data["run"] == str(plan_run) and data["error"] is None
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(server.url + "api/steps?since=x")
        assert e.value.code == 400
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(server.url + "nothing-here")
        assert e.value.code == 404
    finally:
        server.stop()


def test_live_run_shows_new_steps(tmp_path, plan_run):
    server = ViewerServer(tmp_path, port=0).start()
    try:
        assert json.loads(_get(server.url + "api/steps")[2])["waiting"] is True
        shutil.copy(plan_run / "steps.jsonl", tmp_path / "steps.jsonl")
        assert json.loads(_get(server.url + "api/steps")[2])["total"] == 3
    finally:
        server.stop()


def test_cli_errors_are_clear(tmp_path, capsys):
    assert main(["dashboard", str(tmp_path / "missing")]) == 2
    assert "run directory" in capsys.readouterr().err
    server = ViewerServer(tmp_path, port=0)
    try:
        assert main(["dashboard", str(tmp_path), "--port", str(server.server_address[1])]) == 2
        assert "pick another with --port" in capsys.readouterr().err
    finally:
        server.server_close()


def test_train_serves_the_viewer_while_it_runs(tmp_path, monkeypatch, capsys):
    """`flexorch train --dashboard-port 0`: the page answers during the run and the port is released after it.

    `run_train` is replaced at its seam (the real one is tested end to end elsewhere) by a stand-in that writes a
    recorded step into the run directory and asks the running viewer for it."""
    import flexorch.cli.train as train_command

    seen = {}

    def fake_run_train(cfg, address=None, resume_command=None):
        url = capsys.readouterr().out.split("plan viewer: ")[1].split()[0]
        shutil.copy(RECORDED / "steps.jsonl", Path(cfg.run_dir) / "steps.jsonl")
        seen["url"], seen["data"] = url, json.loads(_get(url + "api/steps")[2])
        return {}

    monkeypatch.setattr(train_command, "run_train", fake_run_train)
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), "--steps", "2", "--dashboard-port", "0"]) == 0
    assert seen["url"].startswith("http://127.0.0.1:") and seen["data"]["total"] == 5
    with pytest.raises(urllib.error.URLError):
        _get(seen["url"])


def _op_keys(pipe: dict) -> list[tuple[int, str, int]]:
    return sorted((s, k, u) for s in range(pipe["stages"]) for k in "FB" for u in range(len(pipe["units"])))


def test_pipeline_plan_records_served_as_one_op_view_per_stage_kind_unit():
    records = pipeline_plan_records()
    server = ViewerServer(RECORDED_PIPELINE, port=0).start()
    try:
        data = json.loads(_get(server.url + "api/steps")[2])
    finally:
        server.stop()
    assert data["error"] is None and data["total"] == len(data["records"]) == len(records) >= 2
    for rec, view in zip(records, data["records"], strict=True):
        pipe, pv = rec["pipeline"], view["pipeline"]
        assert view["groups"] == [] and view["micro_batches"] == 0 and view["shape"] == rec["shape"]
        assert view["source"] == "plan" and view["measured_ms"] is None
        assert (pv["stages"], pv["degree"], pv["stage_ranks"]) == (pipe["stages"], pipe["degree"], pipe["stage_ranks"])
        assert pv["bubble_share"] == pipe["bubble_share"] and pv["units"] == len(pipe["units"])
        assert pv["measured_bubble_share"] is None  # a plan record measured nothing
        assert sorted((o["stage"], o["kind"], o["unit"]) for o in pv["ops"]) == _op_keys(pipe)
        predicted = {(o["stage"], o["kind"], o["unit"]): o for o in pipe["ops"]}
        for o in pv["ops"]:
            want, unit = predicted[(o["stage"], o["kind"], o["unit"])], pipe["units"][o["unit"]]
            assert o["predicted_start_ms"] == want["start_ms"]
            assert o["predicted_start_ms"] + o["predicted_ms"] == pytest.approx(want["end_ms"], rel=1e-12)
            assert (o["chain"], o["pipeline"], o["tokens"]) == (unit["chain"], unit["pipeline"], unit["tokens"])
            assert o["pieces"] == len(unit["pieces"])
            assert o["checkpointed"] == pipe["checkpointed"][o["stage"]][o["unit"]]
            assert o["measured_start_ms"] is None and o["measured_ms"] is None  # a plan record measured nothing
        ends = [o["predicted_start_ms"] + o["predicted_ms"] for o in pv["ops"]]
        assert max(ends) == pytest.approx(rec["predicted_ms"], rel=1e-9)
    # the fixture's first step recomputes checkpointed layers on some backward
    assert any(o["checkpointed"] > 0 for o in data["records"][0]["pipeline"]["ops"] if o["kind"] == "B")
    # and an SP record's view has no pipeline
    assert all(v["pipeline"] is None and v["groups"] for v in read_run(RECORDED)["records"])


def test_pipelined_train_record_measures_each_op_on_its_stage_ranks():
    """A trained pipelined step (built from the plan fixture: source train, the train keys, ranks[].ops): each op's
    measured bar starts at the latest start and lasts the longest time over its stage's ranks that reported it."""
    plan_rec = pipeline_plan_records()[0]
    pipe = plan_rec["pipeline"]
    d = pipe["degree"]
    assert d >= 2  # the fixture has several ranks per stage
    lost = pipe["stage_ranks"][1][0]  # stage 1 lost its (late-starting) first rank after the update
    rec = train_record_from_plan(plan_rec, lost=(lost,))
    assert validate_record(rec) is rec
    view = step_view(rec)
    assert view["source"] == "train" and view["measured_ms"] == rec["measured_ms"] and view["groups"] == []
    assert (
        view["pipeline"]["measured_bubble_share"] == measured_bubble_share(rec) and 0 < measured_bubble_share(rec) < 1
    )
    ops = view["pipeline"]["ops"]
    assert sorted((o["stage"], o["kind"], o["unit"]) for o in ops) == _op_keys(pipe)
    for o in ops:
        ranks = pipe["stage_ranks"][o["stage"]]
        alive = [j for j, r in enumerate(ranks) if r != lost]
        reported = [measured_op(o["predicted_start_ms"], o["predicted_ms"], j) for j in alive]
        assert o["measured_start_ms"] == pytest.approx(max(t0 for t0, _ in reported), rel=1e-12)
        assert o["measured_ms"] == pytest.approx(max(ms for _, ms in reported), rel=1e-9)
        if o["stage"] == 1:  # its late rank is lost: on time, and as slow as its last rank
            assert o["measured_start_ms"] == pytest.approx(o["predicted_start_ms"] * 1.25, rel=1e-12)
        else:  # the start is the first rank's (late), the time the last rank's (slowest): two ranks, one bar
            assert o["measured_start_ms"] == pytest.approx(o["predicted_start_ms"] * 1.25 + LATE_MS, rel=1e-12)
        assert o["measured_ms"] == pytest.approx(o["predicted_ms"] * (1.1 + SLOW * (d - 1)), rel=1e-9)
    # a stage whose every rank was lost has no measured ops; the other stages keep theirs
    rec = validate_record(train_record_from_plan(plan_rec, lost=tuple(pipe["stage_ranks"][2])))
    for o in step_view(rec)["pipeline"]["ops"]:
        assert (o["measured_ms"] is None) == (o["stage"] == 2) and (o["measured_start_ms"] is None) == (o["stage"] == 2)


def test_mixed_run_serves_both_kinds_of_views(tmp_path):
    """One run directory with SP train records, pipelined plan records and a pipelined train record."""
    sp_lines = (RECORDED / "steps.jsonl").read_text().splitlines()
    plans = pipeline_plan_records()
    trained = train_record_from_plan(plans[1])
    lines = sp_lines + [json.dumps(r) for r in (plans[0], trained)]
    (tmp_path / "steps.jsonl").write_text("\n".join(lines) + "\n")
    server = ViewerServer(tmp_path, port=0).start()
    try:
        data = json.loads(_get(server.url + "api/steps")[2])
        later = json.loads(_get(server.url + f"api/steps?since={len(sp_lines)}")[2])
    finally:
        server.stop()
    assert data["error"] is None and data["total"] == len(lines)
    kinds = [(v["source"], v["pipeline"] is not None) for v in data["records"]]
    assert kinds == [("train", False)] * len(sp_lines) + [("plan", True), ("train", True)]
    assert [v["shape"] for v in later["records"]] == [plans[0]["shape"], plans[1]["shape"]]
    measured = [o["measured_ms"] for o in later["records"][1]["pipeline"]["ops"]]
    assert len(measured) == len(plans[1]["pipeline"]["ops"]) and all(m > 0 for m in measured)


FAILURE = {  # a worker lost during step 1: seen by its heartbeat, the world re-formed, the step re-run
    "what": "run step 1",
    "attempt": 0,
    "decisions": ["Shrink"],
    "lost": [3],
    "reason": "worker 3 stopped beating",
    "world_before": [0, 1, 2, 3],
    "world_after": [0, 1, 2],
    "step_completed": False,
    "recovery_ms": 400.0,
    "detected_by": "heartbeat",
    "detect_ms": 10100.0,
    "rerun_ms": 1500.0,
    "total_ms": 12000.0,
}
GROW = {"what": "grow", "joined": [4], "world_before": [0, 1, 2], "world_after": [0, 1, 2, 4], "recovery_ms": 230.0}
ROLLBACK = {
    "what": "run step 4",
    "rollback": True,
    "lost": [1],
    "reason": "stage 1's parameters died with every holder",
    "from_step": 4,
    "to_step": 2,
    "world_before": [0, 2],
    "world_after": [0, 2],
    "recovery_ms": 1234.0,
}
RAY_FAILURE = {  # two workers lost during step 3, reported by Ray before any heartbeat was missed
    "what": "run step 3",
    "attempt": 0,
    "decisions": ["Shrink"],
    "lost": [0, 4],
    "reason": "node of workers 0, 4 died",
    "world_before": [0, 1, 2, 4],
    "world_after": [1, 2],
    "step_completed": False,
    "recovery_ms": 300.0,
    "detected_by": "ray",
    "detect_ms": 250.0,
    "rerun_ms": 1450.0,
    "total_ms": 2000.0,
}
OLD_FAILURE = {  # written before detect / re-run / total were recorded
    "what": "run step 3",
    "decisions": ["Shrink"],
    "lost": [2],
    "reason": "Ray reported worker 2 dead",
    "world_before": [0, 1, 2],
    "world_after": [0, 1],
    "step_completed": True,
    "recovery_ms": 2500.0,
}


def recorded_run_with_recoveries(run_dir: Path) -> list[dict]:
    """The recorded run with a failure (phases as lived) in step 1, a grow in step 2, one Ray reported in step 3,
    and in the last step an older record's failure (no phases) and a roll-back; written to ``run_dir/steps.jsonl``,
    returned as records."""
    records = [json.loads(line) for line in (RECORDED / "steps.jsonl").read_text().splitlines()]
    records[1]["recoveries"] = [FAILURE]
    records[2]["recoveries"] = [GROW]
    records[3]["recoveries"] = [RAY_FAILURE]
    records[-1]["recoveries"] = [OLD_FAILURE, ROLLBACK]
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def test_recovery_phases_reach_the_page_json(tmp_path):
    """The page reads each recovery's phases (detect and by what, re-form, re-run, total), a grow's joined workers
    and admission time and a roll-back's steps from /api/steps, as recorded; steps without one have none."""
    records = recorded_run_with_recoveries(tmp_path)
    server = ViewerServer(tmp_path, port=0).start()
    try:
        data = json.loads(_get(server.url + "api/steps")[2])
    finally:
        server.stop()
    assert data["error"] is None and data["total"] == len(records)
    views = data["records"]
    assert views[0]["recoveries"] == [] and views[1]["recoveries"] == [FAILURE]
    (failure,) = views[1]["recoveries"]
    assert (failure["detected_by"], failure["detect_ms"], failure["recovery_ms"]) == ("heartbeat", 10100.0, 400.0)
    assert (failure["rerun_ms"], failure["total_ms"], failure["lost"]) == (1500.0, 12000.0, [3])
    assert views[2]["recoveries"] == [GROW] and views[2]["recoveries"][0]["joined"] == [4]
    assert views[3]["recoveries"] == [RAY_FAILURE] and views[3]["recoveries"][0]["detected_by"] == "ray"
    old, rollback = views[-1]["recoveries"]
    assert old == OLD_FAILURE and "detect_ms" not in old and "total_ms" not in old
    assert (rollback["rollback"], rollback["from_step"], rollback["to_step"]) == (True, 4, 2)
    # the figures the CLI's progress line prints for that step, from the same record
    line = format_step({**records[1], "eta_s": 0.0}, len(records))
    assert line.endswith("[recovered in 12.0 s: detect 10.1 s, re-form 0.4 s, re-run 1.5 s]")


# ---------------------------------------------------------------- a step of several [[tasks]]
MT_TASKS = {  # chat's 3 documents are the batch's sequences 0-2, code's 3 are 3-5 (TaskStreams._combine's order)
    "chat": {"docs": 3, "tokens": 500, "targets": 380, "loss": 2.5},
    "code": {"docs": 3, "tokens": 1960, "targets": 1957, "loss": 3.25},
}
MULTITASK = {
    "multitask": "spindle",
    "parts": [[0, 0, 2, 0.0, 52.0], [1, 2, 2, 0.0, 251.0]],
    "bound_ms": 240.0,
    "makespan_ms": 251.0,
    "gap": 251.0 / 240.0 - 1.0,
    "simulated_ms": 250.0,
    "dataflow_ms": 249.0,
    "solve_s": 0.012,
}


def multitask_record(step: int = 0) -> dict:
    """A trained step of two ``[[tasks]]``, built by hand after ``flexorch.step/4`` (with ``tasks``, ``task_losses``
    and ``multitask``): Spindle put chat on ranks 0-1 and code on ranks 2-3; two micro-batches, each with a group of
    each task (in the second, code's group comes first); rank 1 sits the second micro-batch out."""
    lengths = [300, 120, 80, 900, 1000, 60]
    micro_batches = [
        [
            {"degree": 2, "kind": "ulysses", "ranks": [0, 1], "seq_ids": [0, 1], "seq_lengths": [300, 120]},
            {"degree": 2, "kind": "ring", "ranks": [2, 3], "seq_ids": [3], "seq_lengths": [900]},
        ],
        [
            {"degree": 2, "kind": "ring", "ranks": [2, 3], "seq_ids": [5, 4], "seq_lengths": [60, 1000]},
            {"degree": 1, "kind": "ulysses", "ranks": [0], "seq_ids": [2], "seq_lengths": [80]},
        ],
    ]
    timeline = [
        {"micro_batch": 0, "group": 0, "start_ms": 0.0, "time_ms": 40.0},
        {"micro_batch": 0, "group": 1, "start_ms": 0.0, "time_ms": 120.0},
        {"micro_batch": 1, "group": 0, "start_ms": 120.0, "time_ms": 130.0},
        {"micro_batch": 1, "group": 1, "start_ms": 120.0, "time_ms": 10.0},
    ]
    times = [([41.0, 11.0], [0.0, 125.0]), ([42.0, None], [0.0, None]), ([118.0, 131.0], [0.0, 121.0])]
    times.append(([121.0, 129.0], [1.0, 122.0]))
    ranks = [
        {
            "micro_batch_ms": ms,
            "micro_batch_start_ms": starts,
            "compute_end_ms": max(s + m for s, m in zip(starts, ms, strict=True) if m is not None),
            "local_tokens": 100,
            "peak_local_tokens": 100,
            "peak_activation_bytes": 1 << 20,
        }
        for ms, starts in times
    ]
    return validate_record(
        {
            "schema": "flexorch.step/4",
            "source": "train",
            "step": step,
            "time": 1_795_000_000.0 + step,
            "epoch": 0,
            "batch_index": step,
            "doc_ids": [2, 0, 5, 11, 14, 9],
            "seq_lengths": lengths,
            "tokens": sum(n - 1 for n in lengths),
            "targets": 380 + 1957,
            "world_size": 4,
            "worker_ids": [0, 1, 2, 3],
            "mode": "adaptive",
            "status": "spindle",
            "skipped": False,
            "reason": None,
            "shape": "<2, 2> | <2, 1>",
            "plan": {"num_devices": 4, "micro_batches": micro_batches},
            "timeline": timeline,
            "solve_s": 0.012,
            "predicted_ms": 250.0,
            "bound_ms": 0.0,
            "baselines_ms": {},
            "pipeline": None,
            "recoveries": [],
            "plan_wait_ms": 0.0,
            "measured_ms": 290.0,
            "compute_ms": 260.0,
            "sync_ms": 10.0,
            "optim_ms": 5.0,
            "dispatch_ms": 3.0,
            "overhead_ms": 1.0,
            "loss": 2.875,
            "tokens_per_s": 8000.0,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "ranks": ranks,
            "task_losses": {n: t["loss"] for n, t in MT_TASKS.items()},
            "tasks": json.loads(json.dumps(MT_TASKS)),
            "multitask": json.loads(json.dumps(MULTITASK)),
        }
    )


def multitask_run(run_dir: Path) -> list[dict]:
    """Two steps of two tasks in ``run_dir/steps.jsonl`` (the second with other losses); returned as records."""
    records = [multitask_record(0), multitask_record(1)]
    records[1]["tasks"]["chat"]["loss"] = records[1]["task_losses"]["chat"] = 2.25
    records[1]["tasks"]["code"]["loss"] = records[1]["task_losses"]["code"] = 3.0
    records[1]["loss"] = 2.625
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


AUTO_MODES = ("none", "selective", "full")


def auto_recompute_run(run_dir: Path) -> list[dict]:
    """The recorded run as 'auto' recompute records it (``recompute``, ``recompute_packing``): group i of each
    micro-batch in mode ``AUTO_MODES[i % 3]``, every step packed for no recompute's bytes; in ``run_dir``."""
    records = [json.loads(line) for line in (RECORDED / "steps.jsonl").read_text().splitlines()]
    for rec in records:
        rec["recompute"] = [[AUTO_MODES[gi % 3] for gi in range(len(mb))] for mb in rec["plan"]["micro_batches"]]
        rec["recompute_packing"] = {"packing": "none", "full_ms": 1.25 * rec["predicted_ms"]}
        rec["recompute_packing"]["none_ms"] = rec["predicted_ms"]
        validate_record(rec)
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def test_each_group_carries_the_recompute_mode_it_ran_in(tmp_path):
    records = auto_recompute_run(tmp_path)
    views = read_run(tmp_path)["records"]
    for rec, view in zip(records, views, strict=True):
        assert [g["recompute"] for g in view["groups"]] == [m for row in rec["recompute"] for m in row]
        assert view["recompute_packing"] == rec["recompute_packing"]
    assert all(g["recompute"] is None for v in read_run(RECORDED)["records"] for g in v["groups"])


def test_each_group_of_a_multitask_step_takes_the_task_of_its_sequences():
    rec = multitask_record()
    assert seq_tasks(rec) == [0, 0, 0, 1, 1, 1]
    view = step_view(rec)
    assert [(g["micro_batch"], g["group"], g["task"]) for g in view["groups"]] == [
        (0, 0, 0),
        (0, 1, 1),
        (1, 0, 1),  # code's group comes first in the second micro-batch: the task follows the sequences
        (1, 1, 0),
    ]
    # the legend: each task in order with its colour (the SVG pictures' palette), loss, documents and placement
    assert view["tasks"] == [
        {
            "index": 0,
            "name": "chat",
            "colour": task_colour(0),
            "docs": 3,
            "tokens": 500,
            "targets": 380,
            "loss": 2.5,
            "sequences": [0, 1, 2],
            "groups": 2,
            "ranks": [0, 1],
        },
        {
            "index": 1,
            "name": "code",
            "colour": task_colour(1),
            "docs": 3,
            "tokens": 1960,
            "targets": 1957,
            "loss": 3.25,
            "sequences": [3, 4, 5],
            "groups": 2,
            "ranks": [2, 3],
        },
    ]
    assert task_colour(0) != task_colour(1) and view["task_note"] is None
    mt = view["multitask"]
    assert mt["method"] == "spindle" and mt["bound_ms"] == 240.0 and mt["gap"] == pytest.approx(11 / 240)
    assert (mt["makespan_ms"], mt["simulated_ms"], mt["dataflow_ms"], mt["solve_s"]) == (251.0, 250.0, 249.0, 0.012)
    assert mt["parts"] == [
        {"task": 0, "name": "chat", "first_rank": 0, "devices": 2, "ranks": [0, 1], "start_ms": 0.0, "time_ms": 52.0},
        {"task": 1, "name": "code", "first_rank": 2, "devices": 2, "ranks": [2, 3], "start_ms": 0.0, "time_ms": 251.0},
    ]
    # the measured bars are as for any step; rank 1 sat the second micro-batch out
    assert [g["measured_ms"] for g in view["groups"]] == [42.0, 121.0, 131.0, 11.0]
    # a record without tasks: no task anywhere, the rest of its view as before
    plain = step_view(json.loads((RECORDED / "steps.jsonl").read_text().splitlines()[0]))
    assert (plain["tasks"], plain["multitask"], plain["task_note"]) == (None, None, None)
    assert all(g["task"] is None for g in plain["groups"])


def test_multitask_views_reach_the_page_json(tmp_path):
    records = multitask_run(tmp_path)
    server = ViewerServer(tmp_path, port=0).start()
    try:
        data = json.loads(_get(server.url + "api/steps")[2])
    finally:
        server.stop()
    assert data["error"] is None and data["total"] == 2
    for rec, view in zip(records, data["records"], strict=True):
        assert [t["name"] for t in view["tasks"]] == list(rec["tasks"])
        assert [t["loss"] for t in view["tasks"]] == list(rec["task_losses"].values())
        assert [g["task"] for g in view["groups"]] == [0, 1, 1, 0] and view["multitask"]["method"] == "spindle"


def test_task_docs_that_do_not_add_up_leave_the_groups_without_a_task():
    rec = multitask_record()
    rec["tasks"]["code"]["docs"] = 2  # 5 documents for the batch's 6 sequences: no task can be told
    rec["tasks"]["chat"]["loss"] = float("nan")  # a diverged task: no number (NaN would break the page's JSON)
    assert seq_tasks(rec) is None
    view = step_view(rec)
    assert all(g["task"] is None for g in view["groups"])
    assert [(t["name"], t["loss"], t["sequences"]) for t in view["tasks"]] == [("chat", None, []), ("code", 3.25, [])]
    assert "do not add up to the batch's 6 sequences" in view["task_note"]
    json.dumps(view, allow_nan=False)
    # a group that mixes tasks is no one task's, and says so
    rec = multitask_record()
    rec["plan"]["micro_batches"][0][0]["seq_ids"] = [0, 3]
    rec["plan"]["micro_batches"][0][1]["seq_ids"] = [1]
    view = step_view(rec)
    assert [g["task"] for g in view["groups"]] == [None, 0, 1, 0] and "several tasks" in view["task_note"]
    # malformed optional keys draw no tasks rather than failing the page
    for bad in ({"tasks": [1, 2]}, {"tasks": {"chat": 3}}, {"tasks": {}}):
        view = step_view({**multitask_record(), **bad})
        assert view["tasks"] is None and all(g["task"] is None for g in view["groups"])
    view = step_view({**multitask_record(), "multitask": {"multitask": "in_turn", "parts": [["x"], [0, 0, 4, 0, 1]]}})
    assert view["multitask"]["method"] == "in_turn" and len(view["multitask"]["parts"]) == 1
    assert view["multitask"]["bound_ms"] is None


class _TaskCorpus:  # what TaskStreams reads of a Corpus of several tasks
    def __init__(self, sizes):
        self.task_of = np.concatenate([np.full(n, t, dtype=np.int32) for t, n in enumerate(sizes)])
        self.task_names = tuple(f"t{t}" for t in range(len(sizes)))


def test_the_task_of_each_sequence_is_the_one_task_streams_put_there():
    """The viewer's derivation (cumulative ``tasks[t].docs``) against ``TaskStreams``' own batches: each task's
    documents, task 0's first; with tasks of different sizes, so short batches at a task's epoch end count too."""
    from flexorch.data.task_corpus import TaskStreams

    corpus = _TaskCorpus([7, 3, 11])
    streams = TaskStreams(corpus, [3, 2, 4], seed=5)
    short = 0
    for _ in range(12):
        batch = streams.next_batch()
        truth = corpus.task_of[list(batch.doc_ids)].tolist()
        docs = np.bincount(truth, minlength=3).tolist()
        short += docs != [3, 2, 4]
        rec = {"tasks": {n: {"docs": d} for n, d in zip(corpus.task_names, docs, strict=True)}}
        assert seq_tasks({**rec, "seq_lengths": [1] * len(truth)}) == truth
    assert short > 0
