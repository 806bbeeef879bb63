"""The plan viewer rendered in headless Chromium (Debian's chromium + chromium-driver, driven by Selenium).

Serves a recorded training run (``tests/data/recorded_run``, written by a real `flexorch train`), opens the page and
checks what Plotly actually drew: one bar per SP group of the selected step in the predicted and the measured
picture, one table row per step, clicking a row selects that step; a malformed record shows an error banner, not a
blank page. Pipelined steps (``tests/data/recorded_pipeline_plan``, written by a real `flexorch plan
--pipeline-stages`, and a trained step built from it) are drawn stages x time, one bar per forward and backward op,
with a note; a run mixing both kinds switches between the pictures. A run of several ``[[tasks]]`` (hand-built records
after the schema) colours each group by its task, with the tasks and their losses in the legend and a panel of the
tasks' numbers and placement. A slow worker's device is shaded with its speed. Screenshots are kept in
``build/test-artifacts/`` (or ``$FLEXORCH_TEST_ARTIFACTS``).

Without Chromium the test is skipped, unless ``FLEXORCH_REQUIRE_BROWSER=1`` (CI sets it after installing it), where a
missing browser fails it.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from flexorch.cli.plan import PlanRunConfig, run_plan
from flexorch.cli.train_console import format_step
from flexorch.dashboards.viewer import ViewerServer
from flexorch.records.writer import measured_bubble_share
from flexorch.solver.planner import PlannerConfig
from flexorch.solver.profiles import get_profile
from tests.paths import DATA, REPO
from tests.pipeline_helpers import RECORDED_PIPELINE, TIGHT_PROFILE, pipeline_plan_records, train_record_from_plan
from tests.unit.test_viewer_server import (
    AUTO_MODES,
    SLOW_RANK,
    auto_recompute_run,
    multitask_run,
    recorded_run_with_recoveries,
    slow_worker_run,
)

pytestmark = pytest.mark.slow  # headless Chromium end to end: about 25 s

RECORDED = DATA / "recorded_run"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def _artifacts() -> Path:
    out = Path(os.environ.get("FLEXORCH_TEST_ARTIFACTS", REPO / "build" / "test-artifacts"))
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def browser():
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        if os.environ.get("FLEXORCH_REQUIRE_BROWSER") == "1":
            pytest.fail(
                f"FLEXORCH_REQUIRE_BROWSER=1 but {CHROMIUM} or {CHROMEDRIVER} is missing (apt install chromium "
                "chromium-driver)"
            )
        pytest.skip("headless Chromium is not installed (apt install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="fx-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",  # this machine's network is closed: no update or sync calls
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1400,1400",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _wait(driver, script: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = driver.execute_script(script)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"the page never satisfied: {script}")
        time.sleep(0.2)


def _bars(driver, div: str) -> int:
    return driver.execute_script(f"return document.querySelectorAll('#{div} g.trace.bars g.point').length")


def _groups(rec: dict) -> int:
    return sum(len(mb) for mb in rec["plan"]["micro_batches"])


def test_recorded_run_renders_one_bar_per_group(browser):
    records = [json.loads(line) for line in (RECORDED / "steps.jsonl").read_text().splitlines()]
    server = ViewerServer(RECORDED, port=0, poll_s=0.5).start()
    try:
        browser.get(server.url)
        last = records[-1]
        # follows the latest step: both pictures drawn for it
        _wait(browser, f"return document.getElementById('plan-measured').dataset.step === '{last['step']}'")
        rows = browser.execute_script("return document.querySelectorAll('#step-table tbody tr').length")
        assert rows == len(records)
        assert _bars(browser, "plan-predicted") == _groups(last)
        assert _bars(browser, "plan-measured") == _groups(last)
        assert browser.execute_script("return document.getElementById('error').offsetParent") is None  # hidden
        # the run chart has the predicted and measured series, one point per step
        n = browser.execute_script(
            "return document.getElementById('run-chart').data.filter(t => t.name === 'measured')[0].x.length"
        )
        assert n == len(records)
        # the step table's cells are the records' values
        first = browser.execute_script(
            "return [...document.querySelectorAll('#step-table tbody tr')[0].cells].map(c => c.textContent)"
        )
        assert first[0] == str(records[0]["step"]) and first[3] == records[0]["shape"]
        browser.save_screenshot(str(_artifacts() / "plan_viewer.png"))

        # pick the step with the most groups by clicking its row
        pick = max(range(len(records)), key=lambda i: (_groups(records[i]), -i))
        browser.execute_script(f"document.querySelectorAll('#step-table tbody tr')[{pick}].click()")
        step = records[pick]["step"]
        _wait(browser, f"return document.getElementById('plan-predicted').dataset.step === '{step}'")
        _wait(browser, f"return document.getElementById('plan-measured').dataset.step === '{step}'")
        assert _bars(browser, "plan-predicted") == _groups(records[pick])
        assert _bars(browser, "plan-measured") == _groups(records[pick])
        assert browser.execute_script("return document.getElementById('follow').checked") is False
        summary = browser.execute_script("return document.getElementById('step-summary').textContent")
        assert summary.startswith(f"step {step}:") and records[pick]["shape"] in summary
        assert "recompute" not in summary  # no 'auto' recompute: no modes, no patterns
        assert browser.execute_script("return document.getElementById('plan-predicted').dataset.recompute") == ""
        script = "return document.getElementById('plan-predicted').data.map(t => t.marker.pattern)"
        patterns = browser.execute_script(script)
        assert patterns == [None] * len(patterns)
        labels = browser.execute_script("return document.getElementById('baselines-chart').data[0].y")
        assert labels[:2] == ["measured", "flexorch plan (predicted)"]
        assert set(labels) - {"measured", "flexorch plan (predicted)", "lower bound"} == {
            k for k, v in records[pick]["baselines_ms"].items() if v is not None
        }
    finally:
        server.stop()


def test_auto_recompute_marks_each_group_s_mode_and_the_packing(browser, tmp_path):
    records = auto_recompute_run(tmp_path)
    rec = max(records, key=_groups)  # the step with the most groups: every mode is drawn
    i = records.index(rec)
    server = ViewerServer(tmp_path, port=0, poll_s=0.5).start()
    try:
        browser.get(server.url)
        _wait(browser, f"return document.querySelectorAll('#step-table tbody tr').length === {len(records)}")
        browser.execute_script(f"document.querySelectorAll('#step-table tbody tr')[{i}].click()")
        _wait(browser, f"return document.getElementById('plan-measured').dataset.step === '{rec['step']}'")
        modes = [m for row in rec["recompute"] for m in row]
        assert set(modes) == set(AUTO_MODES)
        for div in ("plan-predicted", "plan-measured"):
            drawn = browser.execute_script(f"return document.getElementById('{div}').dataset.recompute").split(",")
            assert sorted(drawn) == sorted(modes)
            # the pattern Plotly drew each bar with: hatched = full, dotted = selective, plain = none
            shapes = browser.execute_script(
                f"return document.getElementById('{div}').data.flatMap(t => t.marker.pattern.shape)"
            )
            assert sorted(shapes) == sorted({"none": "", "selective": ".", "full": "/"}[m] for m in modes)
            assert _bars(browser, div) == len(modes)
        hover = browser.execute_script("return document.getElementById('plan-predicted').data[0].customdata[0][9]")
        assert hover in ("<br>no recompute", "<br>selective recompute (MLPs)", "<br>full recompute")
        summary = browser.execute_script("return document.getElementById('step-summary').textContent")
        n = {m: modes.count(m) for m in AUTO_MODES}
        assert (
            f" · recompute: none in {n['none']}, selective in {n['selective']}, full in {n['full']} of {len(modes)} "
            f"groups; packed for no recompute's bytes ({rec['predicted_ms']:,.1f} ms predicted; packed for full "
            f"recompute's: {1.25 * rec['predicted_ms']:,.1f} ms)"
        ) in summary, summary
        browser.save_screenshot(str(_artifacts() / "plan_viewer_auto_recompute.png"))
    finally:
        server.stop()


def test_malformed_record_shows_an_error_not_a_blank_page(browser, tmp_path):
    lines = (RECORDED / "steps.jsonl").read_text().splitlines()
    bad = json.loads(lines[2])
    bad["world_size"] = "four"
    (tmp_path / "steps.jsonl").write_text("\n".join([lines[0], lines[1], json.dumps(bad)]) + "\n")
    server = ViewerServer(tmp_path, port=0, poll_s=0.5).start()
    try:
        browser.get(server.url)
        text = _wait(
            browser,
            "return document.getElementById('error').offsetParent && document.getElementById('error').textContent",
        )
        assert "steps.jsonl line 3: 'world_size' is str 'four', expected integer" in text
        # the two good steps are still shown
        _wait(browser, "return document.querySelectorAll('#step-table tbody tr').length === 2")
        assert _bars(browser, "plan-predicted") == _groups(json.loads(lines[1]))
        browser.save_screenshot(str(_artifacts() / "plan_viewer_error.png"))
    finally:
        server.stop()


def test_page_follows_a_run_as_it_writes_steps(browser, tmp_path):
    lines = (RECORDED / "steps.jsonl").read_text().splitlines()
    server = ViewerServer(tmp_path, port=0, poll_s=0.3).start()
    try:
        browser.get(server.url)
        _wait(browser, "return document.getElementById('waiting').offsetParent !== null")  # no records yet
        path = tmp_path / "steps.jsonl"
        path.write_text(lines[0] + "\n")
        _wait(browser, "return document.querySelectorAll('#step-table tbody tr').length === 1")
        with path.open("a") as f:
            f.write("\n".join(lines[1:]) + "\n")
        _wait(browser, f"return document.querySelectorAll('#step-table tbody tr').length === {len(lines)}")
        last = json.loads(lines[-1])
        _wait(browser, f"return document.getElementById('plan-measured').dataset.step === '{last['step']}'")
        assert _bars(browser, "plan-measured") == _groups(last)
        assert browser.execute_script("return document.getElementById('waiting').offsetParent") is None
    finally:
        server.stop()


def test_a_fallback_step_says_why_in_the_table_and_the_summary(browser, tmp_path):
    lines = (RECORDED / "steps.jsonl").read_text().splitlines()
    fb = json.loads(lines[1])
    fb["status"] = "fallback"
    fb["fallback"] = {"reason": "timeout", "message": "the planner gave no plan within plan.timeout_s=15 s"}
    fb["solver_crashes"] = 2
    (tmp_path / "steps.jsonl").write_text("\n".join([lines[0], json.dumps(fb), lines[2]]) + "\n")
    server = ViewerServer(tmp_path, port=0, poll_s=0.5).start()
    try:
        browser.get(server.url)
        _wait(browser, "return document.querySelectorAll('#step-table tbody tr').length === 3")
        cells = browser.execute_script(
            "return [...document.querySelectorAll('#step-table tbody tr')].map(r => r.cells[4].textContent)"
        )
        assert cells[1] == "fallback (timeout)" and "(" not in cells[0] + cells[2]
        marked = browser.execute_script(
            "return [...document.querySelectorAll('#step-table tbody tr')].map(r => r.classList.contains('fallback'))"
        )
        assert marked == [False, True, False]
        browser.execute_script("document.querySelectorAll('#step-table tbody tr')[1].click()")
        _wait(browser, f"return document.getElementById('plan-predicted').dataset.step === '{fb['step']}'")
        summary = browser.execute_script("return document.getElementById('step-summary').textContent")
        assert "not the planner's plan (timeout): the planner gave no plan within plan.timeout_s=15 s" in summary
        assert "2 MILP solve(s) crashed" in summary
    finally:
        server.stop()


def _ticks(driver, div: str) -> list[str]:
    return driver.execute_script(
        f"return [...document.querySelectorAll('#{div} g.ytick text')].map(t => t.textContent)"
    )


def _note(driver) -> str | None:
    return driver.execute_script(
        "const n = document.getElementById('pipeline-note'); return n.offsetParent === null ? null : n.textContent"
    )


def _stage_rows(rec: dict) -> list[str]:
    return [f"stage {r} (ranks {min(rs)}-{max(rs)})" for r, rs in enumerate(rec["pipeline"]["stage_ranks"])]


def test_pipeline_plan_renders_one_bar_per_op_on_stage_rows(browser):
    records = pipeline_plan_records()
    server = ViewerServer(RECORDED_PIPELINE, port=0, poll_s=0.5).start()
    try:
        browser.get(server.url)
        last = records[-1]
        _wait(browser, f"return document.getElementById('plan-predicted').dataset.step === '{last['step']}'")
        assert browser.execute_script("return document.getElementById('plan-predicted').dataset.layout") == "pipeline"
        assert _bars(browser, "plan-predicted") == len(last["pipeline"]["ops"])
        assert _ticks(browser, "plan-predicted") == _stage_rows(last)
        # a plan record measured nothing: no measured picture
        assert browser.execute_script("return document.getElementById('measured-card').offsetParent") is None

        # the step with the most ops, picked in the table; its note says what the picture is
        pick = max(range(len(records)), key=lambda i: (len(records[i]["pipeline"]["ops"]), -i))
        rec, pipe = records[pick], records[pick]["pipeline"]
        browser.execute_script(f"document.querySelectorAll('#step-table tbody tr')[{pick}].click()")
        _wait(browser, f"return document.getElementById('plan-predicted').dataset.step === '{rec['step']}'")
        assert _bars(browser, "plan-predicted") == len(pipe["ops"])
        assert _ticks(browser, "plan-predicted") == _stage_rows(rec)
        title = browser.execute_script("return document.querySelector('#plan-predicted .gtitle').textContent")
        predicted_ms = f"{rec['predicted_ms']:,.1f}"
        assert f"step {rec['step']}: predicted (pipeline simulator), {predicted_ms} ms · bubble" in title
        assert f"bubble {pipe['bubble_share'] * 100:.1f} %" in title
        note = _note(browser)
        assert f"{pipe['stages']} stages x {pipe['degree']} device(s) per stage" in note
        assert f"{len(pipe['units'])} units (granularity {pipe['granularity']}) in one pipeline" in note
        # the bars are where the simulator put them: each trace's bases are its ops' predicted starts
        starts = browser.execute_script(
            "return document.getElementById('plan-predicted').data.map(t => t.base).flat().sort((a, b) => a - b)"
        )
        assert starts == pytest.approx(sorted(o["start_ms"] for o in pipe["ops"]))
        labels = browser.execute_script("return document.getElementById('baselines-chart').data[0].y")
        assert labels[0] == "flexorch plan (predicted)" and set(labels[1:]) == {"1f1b", "seq1f1b-4"}
        summary = browser.execute_script("return document.getElementById('step-summary').textContent")
        assert summary.startswith(f"step {rec['step']}:") and rec["shape"] in summary
        browser.save_screenshot(str(_artifacts() / "plan_viewer_pipeline.png"))
    finally:
        server.stop()


def test_mixed_run_switches_between_sp_and_pipeline_pictures(browser, tmp_path):
    sp_lines = (RECORDED / "steps.jsonl").read_text().splitlines()
    sp_records = [json.loads(line) for line in sp_lines]
    plans = pipeline_plan_records()
    n_sp = len(sp_records)
    plan_rec = dict(plans[0], step=n_sp)
    trained = train_record_from_plan(dict(plans[1], step=n_sp + 1))
    (tmp_path / "steps.jsonl").write_text("\n".join(sp_lines + [json.dumps(plan_rec), json.dumps(trained)]) + "\n")
    server = ViewerServer(tmp_path, port=0, poll_s=0.5).start()
    rows = "document.querySelectorAll('#step-table tbody tr')"
    try:
        browser.get(server.url)
        # follows the latest step: a trained pipelined step, drawn predicted and measured, one bar per op in each
        _wait(browser, f"return document.getElementById('plan-measured').dataset.step === '{trained['step']}'")
        _wait(browser, f"return document.getElementById('plan-predicted').dataset.step === '{trained['step']}'")
        assert browser.execute_script(f"return {rows}.length") == n_sp + 2
        for div in ("plan-predicted", "plan-measured"):
            assert _bars(browser, div) == len(trained["pipeline"]["ops"])
            assert _ticks(browser, div) == _stage_rows(trained)
        title = browser.execute_script("return document.querySelector('#plan-measured .gtitle').textContent")
        bubble = measured_bubble_share(trained)
        assert (
            title == f"step {trained['step']}: measured, {trained['measured_ms']:,.1f} ms · bubble {bubble * 100:.1f} %"
        )
        assert _note(browser) is not None
        browser.save_screenshot(str(_artifacts() / "plan_viewer_pipeline_trained.png"))
        measured = browser.execute_script(
            "return document.getElementById('run-chart').data.filter(t => t.name === 'measured')[0].y"
        )  # every step; a plan record has no measured time
        assert measured == [r["measured_ms"] for r in sp_records] + [None, trained["measured_ms"]]

        # an SP step: groups on device rows, no note
        browser.execute_script(f"{rows}[0].click()")
        _wait(browser, f"return document.getElementById('plan-measured').dataset.step === '{sp_records[0]['step']}'")
        _wait(browser, "return document.getElementById('plan-predicted').dataset.layout === 'sp'")
        assert _bars(browser, "plan-predicted") == _groups(sp_records[0])
        assert _bars(browser, "plan-measured") == _groups(sp_records[0])
        assert _note(browser) is None
        assert not any(t.startswith("stage ") for t in _ticks(browser, "plan-predicted"))

        # the pipelined plan record: the predicted picture only, back on stage rows
        browser.execute_script(f"{rows}[{n_sp}].click()")
        _wait(browser, f"return document.getElementById('plan-predicted').dataset.step === '{plan_rec['step']}'")
        assert browser.execute_script("return document.getElementById('plan-predicted').dataset.layout") == "pipeline"
        assert _bars(browser, "plan-predicted") == len(plan_rec["pipeline"]["ops"])
        assert _ticks(browser, "plan-predicted") == _stage_rows(plan_rec)
        assert browser.execute_script("return document.getElementById('measured-card').offsetParent") is None
        assert _note(browser) is not None

        # and back to an SP step with the arrow key's button (the step before the pipelined one)
        browser.execute_script("document.getElementById('prev').click()")
        _wait(browser, f"return document.getElementById('plan-predicted').dataset.step === '{sp_records[-1]['step']}'")
        _wait(browser, "return document.getElementById('plan-predicted').dataset.layout === 'sp'")
        assert _bars(browser, "plan-predicted") == _groups(sp_records[-1])
        assert browser.execute_script("return document.getElementById('error').offsetParent") is None
        browser.save_screenshot(str(_artifacts() / "plan_viewer_mixed.png"))
    finally:
        server.stop()


def test_back_to_back_pipelines_are_marked(browser, tmp_path):
    """A real plan that memory splits into back-to-back pipelines (``TIGHT_PROFILE``): a dashed line where each
    pipeline but the last drains, and the note says so."""
    profile, lengths = tmp_path / "three-layers.json", tmp_path / "lengths.txt"
    profile.write_text(json.dumps(TIGHT_PROFILE))
    lengths.write_text("3000\n3000\n2800\n2900\n")
    cfg = PlanRunConfig(
        lengths=lengths, workers=2, batch=4, steps=1, pipeline_stages=2, run_dir=tmp_path, planner=PlannerConfig()
    )
    (rec,) = run_plan(cfg, get_profile(profile), out=io.StringIO())
    pipelines = len({u["pipeline"] for u in rec["pipeline"]["units"]})
    assert pipelines > 1
    server = ViewerServer(tmp_path, port=0, poll_s=0.5).start()
    try:
        browser.get(server.url)
        _wait(browser, f"return document.getElementById('plan-predicted').dataset.step === '{rec['step']}'")
        assert _bars(browser, "plan-predicted") == len(rec["pipeline"]["ops"])
        lines = browser.execute_script("return document.getElementById('plan-predicted').layout.shapes.map(s => s.x0)")
        ends = [
            max(o["end_ms"] for o in rec["pipeline"]["ops"] if rec["pipeline"]["units"][o["unit"]]["pipeline"] == p)
            for p in range(pipelines - 1)
        ]
        assert sorted(lines) == pytest.approx(ends)
        assert f"in {pipelines} back-to-back pipelines" in _note(browser)
    finally:
        server.stop()


def test_recoveries_show_their_phases_in_the_table_and_the_summary(browser, tmp_path):
    """Each recovery in the step table's cell, in the CLI's words (total, detect and by what, re-form, re-run), a
    grow's admission and a roll-back's steps; and every recovery of the run in the summary above the table."""
    records = recorded_run_with_recoveries(tmp_path)
    server = ViewerServer(tmp_path, port=0, poll_s=0.5).start()
    try:
        browser.get(server.url)
        _wait(browser, f"return document.querySelectorAll('#step-table tbody tr').length === {len(records)}")
        cells = browser.execute_script(
            "return [...document.querySelectorAll('#step-table tbody tr')].map(r => r.cells[12].innerText)"
        )
        assert len(records) == 5 and cells[0] == ""
        phases = "recovered in 12.0 s: detect 10.1 s, re-form 0.4 s, re-run 1.5 s"
        assert format_step({**records[1], "eta_s": 0.0}, len(records)).endswith(f"[{phases}]")  # the CLI's words
        assert (
            cells[1]
            == f"run step 1: lost worker 3, Shrink, world 4 -> 3, re-ran the step; {phases} (detected by heartbeat)"
        )
        assert cells[2] == "grow: workers 4 joined, world 3 -> 4; admitted in 230 ms"
        # 250 ms is 0.25 s, an exact tie: Python rounds it to the even 0.2, as the page does (JS's toFixed gives 0.3)
        ray = "recovered in 2.0 s: detect 0.2 s, re-form 0.3 s, re-run 1.4 s"
        assert format_step({**records[3], "eta_s": 0.0}, len(records)).endswith(f"[{ray}]")
        assert (
            cells[3] == f"run step 3: lost workers 0, 4, Shrink, world 4 -> 2, re-ran the step; {ray} (detected by Ray)"
        )
        assert cells[-1].split("\n") == [
            "run step 3: lost worker 2, Shrink, world 3 -> 2, the step's update had finished, kept; re-form 2.5 s",
            "run step 4: roll-back: lost worker 1, back to the checkpoint of step 2 (from step 4), world 2 -> 2; "
            "re-form 1.2 s",
        ]
        _wait(browser, "return document.getElementById('recoveries').offsetParent !== null")
        rows = browser.execute_script(
            "return [...document.querySelectorAll('#recovery-table tbody tr')]"
            ".map(r => [...r.cells].map(c => c.textContent))"
        )
        last = str(records[-1]["step"])
        assert rows == [
            [
                str(records[1]["step"]),
                "run step 1",
                "lost worker 3",
                "world 4 -> 3",
                "Shrink, re-ran the step; worker 3 stopped beating",
                f"{phases} (detected by heartbeat)",
            ],
            [str(records[2]["step"]), "grow", "workers 4 joined", "world 3 -> 4", "", "admitted in 230 ms"],
            [
                str(records[3]["step"]),
                "run step 3",
                "lost workers 0, 4",
                "world 4 -> 2",
                "Shrink, re-ran the step; node of workers 0, 4 died",
                f"{ray} (detected by Ray)",
            ],
            [
                last,
                "run step 3",
                "lost worker 2",
                "world 3 -> 2",
                "Shrink, the step's update had finished, kept; Ray reported worker 2 dead",
                "re-form 2.5 s",
            ],
            [
                last,
                "run step 4 (roll-back)",
                "lost worker 1",
                "world 2 -> 2",
                "back to the checkpoint of step 2 (from step 4); stage 1's parameters died with every holder",
                "re-form 1.2 s",
            ],
        ]
        browser.execute_script("document.getElementById('recoveries').scrollIntoView()")
        browser.save_screenshot(str(_artifacts() / "plan_viewer_recoveries.png"))
    finally:
        server.stop()


DRAIN = {
    "what": "drain", "node": "5c7949ce34674f2c", "node_ip": "10.0.0.7", "reason": "preemption",
    "deadline": 1795838176.3, "seen_at": 1795838116.9, "deadline_left_s": 44.6, "workers": [1, 3], "after_step": 1,
    "needed_s": 5.0, "world_before": [0, 1, 2, 3], "world_after": [0, 2], "left": [1, 3], "handoff_ms": 31.0,
    "handoff_bytes": 700000, "reform_ms": 160.0, "recovery_ms": 191.0, "rerun": False, "fallback": None,
}  # fmt: skip
"""A drain's planned leave, as ``control.elastic`` records it (the figures of a run of
tests/cluster/test_drain_cluster.py)."""


def test_a_drained_node_s_planned_leave_shows_in_the_table_and_the_summary(browser, tmp_path):
    """The drain in the CLI's words: the node, its reason and deadline, who left after which step, in what time."""
    from flexorch.cli.train_console import format_membership

    records = [json.loads(line) for line in (RECORDED / "steps.jsonl").read_text().splitlines()]
    records[2]["recoveries"] = [DRAIN]
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    server = ViewerServer(tmp_path, port=0, poll_s=0.5).start()
    try:
        browser.get(server.url)
        _wait(browser, f"return document.querySelectorAll('#step-table tbody tr').length === {len(records)}")
        cells = browser.execute_script(
            "return [...document.querySelectorAll('#step-table tbody tr')].map(r => r.cells[12].innerText)"
        )
        who = "node 10.0.0.7 draining (preemption, 45 s): workers 1, 3 left after step 1"
        assert cells[2] == f"drain: {who}, planned leave, world 4 -> 2, nothing re-run; left in 0.2 s: handoff " \
            "0.0 s, re-form 0.2 s", cells[2]  # fmt: skip
        assert format_membership({"event": "membership", **DRAIN}).startswith(
            "membership: node 10.0.0.7 draining (preemption, 45 s): workers [1, 3] left after step 1 in 0.2 s"
        ), "the page and the CLI say the same"
        _wait(browser, "return document.getElementById('recoveries').offsetParent !== null")
        rows = browser.execute_script(
            "return [...document.querySelectorAll('#recovery-table tbody tr')]"
            ".map(r => [...r.cells].map(c => c.textContent))"
        )
        assert rows == [[str(records[2]["step"]), "drain", who, "world 4 -> 2", "planned leave, nothing re-run; "
                         "preemption", "left in 0.2 s: handoff 0.0 s, re-form 0.2 s"]]  # fmt: skip
    finally:
        server.stop()


def test_a_run_without_recoveries_hides_the_summary(browser):
    server = ViewerServer(RECORDED, port=0, poll_s=0.5).start()
    try:
        browser.get(server.url)
        _wait(browser, "return document.querySelectorAll('#step-table tbody tr').length > 0")
        assert browser.execute_script("return document.getElementById('recoveries').offsetParent") is None
        assert browser.execute_script("return document.querySelectorAll('#recovery-table tbody tr').length") == 0
    finally:
        server.stop()


def _legend(driver, div: str) -> list[str]:
    return driver.execute_script(
        f"return [...document.querySelectorAll('#{div} g.legend text.legendtext')].map(t => t.textContent)"
    )


def _colours(driver, div: str) -> dict[str, str]:
    return driver.execute_script(
        f"return Object.fromEntries(document.getElementById('{div}').data.map(t => [t.name, t.marker.color]))"
    )


def test_multitask_run_colours_groups_by_task_with_a_legend_of_losses(browser, tmp_path):
    records = multitask_run(tmp_path)
    last = records[-1]
    server = ViewerServer(tmp_path, port=0, poll_s=0.5).start()
    try:
        browser.get(server.url)
        _wait(browser, f"return document.getElementById('plan-measured').dataset.step === '{last['step']}'")
        for div in ("plan-predicted", "plan-measured"):
            assert browser.execute_script(f"return document.getElementById('{div}').dataset.colour") == "task"
            assert _bars(browser, div) == _groups(last)
            # the legend: each task's name and its loss this step, in task order
            assert _legend(browser, div) == ["chat · loss 2.2500", "code · loss 3.0000"]
            traces = browser.execute_script(
                f"return document.getElementById('{div}').data.map(t => [t.name, t.y.length, t.text])"
            )
            assert [(name, n) for name, n, _ in traces] == [("chat · loss 2.2500", 2), ("code · loss 3.0000", 2)]
            assert traces[0][2] == ["chat · 2 ulysses · 2 seq", "chat · 1 seq"]
        colours = _colours(browser, "plan-predicted")
        assert colours["chat · loss 2.2500"] != colours["code · loss 3.0000"]
        # the per-step panel: how the tasks were placed, then each task's numbers
        placement = browser.execute_script("return document.getElementById('task-placement').textContent")
        assert placement.startswith("2 tasks, placed Spindle (each task on its own block of workers")
        assert "Spindle's cost model: bound 240.0 ms, makespan 251.0 ms, gap 4.6 %" in placement
        assert "the plan: simulated 250.0 ms, dataflow 249.0 ms" in placement
        rows = browser.execute_script(
            "return [...document.querySelectorAll('#task-table tbody tr')]"
            ".map(r => [...r.cells].map(c => c.textContent))"
        )
        assert rows == [
            ["chat", "ranks 0-1", "0.0 + 52.0", "3", "500", "380", "2.2500", "2"],
            ["code", "ranks 2-3", "0.0 + 251.0", "3", "1,960", "1,957", "3.0000", "2"],
        ]
        summary = browser.execute_script("return document.getElementById('step-summary').textContent")
        assert summary.endswith(" · 2 tasks (spindle)")
        # the step table's tasks column: the method and gap, then each task's loss, documents and targets
        cells = browser.execute_script(
            "return [...document.querySelectorAll('#step-table tbody tr')].map(r => r.cells[13].innerText)"
        )
        assert cells[0].split("\n") == [
            "spindle, gap 4.6 %",
            "chat 2.5000 · 3 docs · 380 targets",
            "code 3.2500 · 3 docs · 1,957 targets",
        ]
        second = cells[1].split("\n")
        assert second[1:] == ["chat 2.2500 · 3 docs · 380 targets", "code 3.0000 · 3 docs · 1,957 targets"]
        browser.save_screenshot(str(_artifacts() / "plan_viewer_tasks.png"))
        # the first step, picked in the table: its own losses in the legend
        browser.execute_script("document.querySelectorAll('#step-table tbody tr')[0].click()")
        _wait(browser, "return document.getElementById('plan-predicted').dataset.step === '0'")
        _wait(browser, "return document.getElementById('plan-measured').dataset.step === '0'")
        assert _legend(browser, "plan-measured") == ["chat · loss 2.5000", "code · loss 3.2500"]
    finally:
        server.stop()


def test_a_run_without_tasks_shows_no_task_column_panel_or_colours(browser):
    server = ViewerServer(RECORDED, port=0, poll_s=0.5).start()
    try:
        browser.get(server.url)
        _wait(browser, "return document.getElementById('plan-predicted').dataset.layout === 'sp'")
        assert browser.execute_script("return document.getElementById('plan-predicted').dataset.colour") == "degree"
        assert all(t.startswith("degree ") for t in _legend(browser, "plan-predicted"))
        assert browser.execute_script("return document.getElementById('tasks-note').offsetParent") is None
        assert browser.execute_script("return document.querySelector('#step-table th.tasks').offsetParent") is None
    finally:
        server.stop()


def test_a_slow_worker_is_shaded_with_its_speed(browser, tmp_path):
    records = slow_worker_run(tmp_path)
    last = records[-1]
    server = ViewerServer(tmp_path, port=0, poll_s=0.5).start()
    try:
        browser.get(server.url)
        _wait(browser, f"return document.getElementById('plan-measured').dataset.step === '{last['step']}'")
        tip = f"rank {SLOW_RANK}: 0.52x the others (slow: below 0.8x)"
        for div in ("plan-predicted", "plan-measured"):
            get = f"document.getElementById('{div}')"
            assert browser.execute_script(f"return {get}.dataset.slow") == str(SLOW_RANK)
            bands = browser.execute_script(
                f"return {get}.layout.shapes.filter(s => s.type === 'rect').map(s => [s.y0, s.y1, s.layer])"
            )
            assert bands == [[SLOW_RANK - 0.5, SLOW_RANK + 0.5, "below"]]  # its row, behind the bars
            labels = browser.execute_script(
                f"return {get}.layout.annotations.filter(a => a.hovertext).map(a => [a.text, a.hovertext])"
            )
            assert labels == [["0.52x", tip]]
            drawn = browser.execute_script(
                f"return [...{get}.querySelectorAll('.annotation-text')].map(e => e.textContent)"
            )
            assert "0.52x" in drawn
            # every group on the slow device says the pace it runs at: its slowest member's
            paces = browser.execute_script(f"return {get}.data.flatMap(t => t.customdata.map(c => c[10]))")
            assert "<br>at 0.52x (its slowest member's speed)" in paces
        summary = browser.execute_script("return document.getElementById('step-summary').textContent")
        assert f" · slow devices (shaded): rank {SLOW_RANK}: 0.52x the others" in summary, summary
        browser.save_screenshot(str(_artifacts() / "plan_viewer_slow_worker.png"))
    finally:
        server.stop()
