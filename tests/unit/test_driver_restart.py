"""A driver started in place of a lost one records that recovery once, with the first step past the one the lost
driver was running (``control.driver_restart``), on the real driver over the in-process fake group."""

from __future__ import annotations

import time

from flexorch.control.driver import TrainingDriver
from flexorch.control.driver_restart import DriverRestart
from flexorch.control.planner_client import LocalPlannerClient
from tests.fake_cluster import FakeWorkerGroup
from tests.unit import test_driver_transitions as transitions
from tests.unit.test_driver_transitions import STATIC, _cfg

corpus, profile = transitions.corpus, transitions.profile  # the fake group's corpus and profile fixtures


def test_the_restart_is_recorded_once_with_the_first_step_past_the_lost_one():
    restart = DriverRestart({"what": "driver lost", "seen_at": time.time() - 2.0, "detect_ms": 100.0, "lost_step": 3})
    restart.set_up(from_step=2, corpus_load_s=0.5)
    early = {"step": 2, "recoveries": []}
    restart.lived(early)
    assert early["recoveries"] == [], "the lost driver's step is not passed yet"
    record = {"step": 3, "recoveries": [{"what": "other"}]}
    restart.lived(record)
    rec = record["recoveries"][-1]
    assert rec["from_step"] == 2 and rec["redone_steps"] == 1 and rec["corpus_ms"] == 500.0
    assert rec["recovery_ms"] >= 2000.0 and "seen_at" not in rec
    assert rec["total_ms"] == rec["detect_ms"] + rec["recovery_ms"] + rec["rerun_ms"]
    again = {"step": 4, "recoveries": []}
    restart.lived(again)
    assert again["recoveries"] == [], "once"


def test_a_restarted_driver_records_its_recovery_with_the_first_step_past_the_lost_one(tmp_path, profile, corpus):
    cfg = _cfg(tmp_path, profile, steps=3, plan=STATIC)
    lost = {"what": "driver lost", "driver_restart": 1, "seen_at": time.time(), "detect_ms": 5.0, "lost_step": 1}
    group = FakeWorkerGroup(cfg, None, ())
    driver = TrainingDriver(cfg, worker_group=group, planner=LocalPlannerClient, corpus=corpus, restarted=lost)
    try:
        driver.setup()
        records = [driver.step().record for _ in range(3)]
    finally:
        driver.shutdown()
    restarts = [[r for r in rec["recoveries"] if r.get("driver_restart")] for rec in records]
    assert [len(r) for r in restarts] == [0, 1, 0]
    (rec,) = restarts[1]
    assert rec["from_step"] == 0 and rec["redone_steps"] == 1 and rec["rerun_ms"] >= 0
