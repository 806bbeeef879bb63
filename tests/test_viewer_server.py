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

import pytest

from dashboards.viewer import ViewerServer
from dashboards.viewer_data import read_run, step_view
from orchestrator.cli import main
from orchestrator.plan_command import PlanRunConfig, run_plan
from solver.planner import PlannerConfig
from solver.profiles import get_profile

RECORDED = Path(__file__).parent / "data" / "recorded_run"


@pytest.fixture(scope="module")
def plan_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("plan-run")
    cfg = PlanRunConfig(devices=8, batch=24, steps=3, planner=PlannerConfig(time_limit_s=0.3), run_dir=run)
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
    import orchestrator.train_command as train_command

    seen = {}

    def fake_run_train(cfg, address=None):
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
