"""The plan viewer rendered in headless Chromium (Debian's chromium + chromium-driver, driven by Selenium).

Serves a recorded training run (``tests/data/recorded_run``, written by a real `flexorch train`), opens the page and
checks what Plotly actually drew: one bar per SP group of the selected step in the predicted and the measured
picture, one table row per step, clicking a row selects that step; a malformed record shows an error banner, not a
blank page. Screenshots are kept in ``build/test-artifacts/`` (or ``$FLEXORCH_TEST_ARTIFACTS``).

Without Chromium the test is skipped, unless ``FLEXORCH_REQUIRE_BROWSER=1`` (CI sets it after installing it), where a
missing browser fails it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from dashboards.viewer import ViewerServer

RECORDED = Path(__file__).parent / "data" / "recorded_run"
ROOT = Path(__file__).resolve().parents[1]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def _artifacts() -> Path:
    out = Path(os.environ.get("FLEXORCH_TEST_ARTIFACTS", ROOT / "build" / "test-artifacts"))
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
        labels = browser.execute_script("return document.getElementById('baselines-chart').data[0].y")
        assert labels[:2] == ["measured", "flexorch plan (predicted)"]
        assert set(labels) - {"measured", "flexorch plan (predicted)", "lower bound"} == {
            k for k, v in records[pick]["baselines_ms"].items() if v is not None
        }
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
