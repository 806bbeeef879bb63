"""A worker that stays slow is retired as failed (``[elastic] retire_below_speed``, ``retire_after_steps``).

Without Ray: the settings and their errors, the policy's decision (``ElasticPolicy.on_slow``: the slowest go first,
never below ``min_workers``), and the executor (``Elastic.retire_slow``) over the in-process fake worker group with a
speed estimate held fixed at the seam (``control.slow_retire.SlowWorkers``): who leaves, the ``retire`` record (reason
"slow", the worker, its node, its speed), the one console line, the warning given once when the world cannot lose
the worker, and nothing asked of the estimate when the retire is off (the default).
"""

from __future__ import annotations

import pytest

from flexorch.config import ConfigError, ElasticSettings, load_train_config
from flexorch.control.elastic import Elastic
from flexorch.control.membership import ElasticPolicy, Retire
from flexorch.control.transitions import Ran
from flexorch.records.step_keys import Recovery
from flexorch.records.writer import read_records
from tests.fake_cluster import FakeWorkerGroup, fake_driver
from tests.unit import test_driver_transitions as transitions
from tests.unit.test_driver_transitions import _batches, _cfg, _check_params

corpus, profile = transitions.corpus, transitions.profile  # the fake group's corpus and profile fixtures


class FixedSpeeds:
    """The speed estimate's seam with fixed speeds: a worker is slow when its speed is below the threshold and it has
    been observed ``steps[worker]`` steps (default: many). Counts what it is asked."""

    def __init__(self, speeds: dict[int, float], steps: dict[int, int] | None = None):
        self.speeds, self.steps = speeds, steps or {}
        self.asked: list[tuple[float, int]] = []

    def slow_workers(self, threshold: float, for_steps: int) -> list[int]:
        self.asked.append((threshold, for_steps))
        return [w for w, s in self.speeds.items() if s < threshold and self.steps.get(w, 99) >= for_steps]

    def estimate(self, worker: int) -> float:
        return self.speeds.get(worker, 1.0)


# ---------------------------------------------------------------- the settings
def _run(**overrides):
    base = {"workers": 4, "data.max_context": 128, "plan.tokens_per_worker": 128, "plan.profile": "gpt-7b-a100"}
    return load_train_config(None, {**base, **overrides})


def test_off_by_default_and_set_from_the_elastic_table():
    cfg = _run()
    assert (cfg.elastic.retire_below_speed, cfg.elastic.retire_after_steps) == (0.0, 5)
    cfg = _run(**{"elastic.retire_below_speed": 0.3, "elastic.retire_after_steps": 3})
    assert (cfg.elastic.retire_below_speed, cfg.elastic.retire_after_steps) == (0.3, 3)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"retire_below_speed": -0.1}, r"retire_below_speed must be a number in \[0, 1\).*got -0.1"),
        ({"retire_below_speed": 1.0}, r"retire_below_speed must be a number in \[0, 1\): 0 turns it off.*got 1.0"),
        ({"retire_below_speed": True}, r"retire_below_speed must be a number in \[0, 1\).*got True"),
        ({"retire_below_speed": "0.3"}, r"retire_below_speed must be a number in \[0, 1\).*got '0.3'"),
        ({"retire_after_steps": 0}, r"elastic.retire_after_steps must be a positive integer \(steps\), got 0"),
        ({"retire_after_steps": 2.5}, r"elastic.retire_after_steps must be a positive integer \(steps\), got 2.5"),
        ({"retire_after_steps": True}, r"elastic.retire_after_steps must be a positive integer \(steps\), got True"),
    ],
)
def test_bad_settings_are_clear_errors(values, message):
    with pytest.raises(ConfigError, match=message):
        ElasticSettings(**values)
    key, value = next(iter(values.items()))
    with pytest.raises(ConfigError, match=message):
        _run(**{f"elastic.{key}": value})


# ---------------------------------------------------------------- the policy's decision
def test_the_slowest_go_first_and_the_world_never_drops_below_min_workers():
    policy = ElasticPolicy(min_workers=2, max_workers=4)
    assert policy.on_slow([0, 1, 2, 3], [3]) == Retire((3,), (0, 1, 2))
    assert policy.on_slow([0, 1, 2, 3], [3, 1]) == Retire((1, 3), (0, 2)), "room for both"
    few = policy.on_slow([0, 1, 2], [2, 0])  # room for one: the slowest (first) goes, the other stays
    assert (few.leaving, few.survivors, few.kept) == ((2,), (0, 1), (0,))
    assert few.reason == "retiring it would leave 1 workers, below min_workers=2"
    none = ElasticPolicy(min_workers=4, max_workers=4).on_slow([0, 1, 2, 3], [1, 2])
    assert (none.leaving, none.survivors, none.kept) == ((), (0, 1, 2, 3), (1, 2))
    assert none.reason == "retiring them would leave 2 workers, below min_workers=4"
    with pytest.raises(ValueError, match=r"workers \[7\] are slow but not members"):
        policy.on_slow([0, 1], [7])


# ---------------------------------------------------------------- the executor over the fake group
def _elastic(tmp_path, profile, min_workers: int = 2, **elastic):
    cfg = _cfg(tmp_path, profile, elastic={"min_workers": min_workers, **elastic})
    group = FakeWorkerGroup(cfg)
    group.form_world()
    events: list[dict] = []
    policy = ElasticPolicy(cfg.min_workers, cfg.max_workers)
    return cfg, group, Elastic(group, policy, events.append, lambda: "no checkpoint"), events


def test_off_by_default_nothing_is_asked_and_nobody_leaves(tmp_path, profile):
    cfg, group, elastic, events = _elastic(tmp_path, profile)
    speeds = FixedSpeeds({3: 0.1})
    assert elastic.retire_slow(speeds, cfg.elastic, 4) == [] and speeds.asked == []
    assert elastic.retire_slow(None, ElasticSettings(retire_below_speed=0.3), 4) == [], "no estimate: nothing to do"
    assert group.worker_ids == (0, 1, 2, 3) and len(group.worlds) == 1 and events == []


def test_a_worker_slow_for_the_steps_asked_is_retired_like_a_drained_node_s_worker(tmp_path, profile):
    cfg, group, elastic, events = _elastic(tmp_path, profile, retire_below_speed=0.3, retire_after_steps=4)
    speeds = FixedSpeeds({0: 1.0, 1: 0.45, 2: 1.02, 3: 0.2}, steps={3: 3})
    planned_for: list[int] = []
    assert elastic.retire_slow(speeds, cfg.elastic, 5, planned_for.append) == [], "3 of 4 steps: not yet"
    assert speeds.asked == [(0.3, 4)] and group.worker_ids == (0, 1, 2, 3) and events == []
    speeds.steps[3] = 4
    (rec,) = elastic.retire_slow(speeds, cfg.elastic, 6, planned_for.append)
    assert planned_for == [3], "the next plan is asked for the smaller world before the handoff"
    assert group.worker_ids == (0, 1, 2) and group.worlds[-1] == (0, 1, 2) and group.retired == [3]
    assert rec["what"] == "retire" and rec["decisions"] == ["Retire"] and rec["lost"] == [3]
    assert rec["slow"] == [{"worker": 3, "node": "node-1", "speed": 0.2}]
    assert rec["reason"] == (
        "slow: worker 3 on node node-1 at 0.20x the others for 4 steps, below [elastic] retire_below_speed = 0.3"
    )
    assert (rec["world_before"], rec["world_after"], rec["after_step"]) == ([0, 1, 2, 3], [0, 1, 2], 6)
    assert rec["rerun"] is False and rec["recovery_ms"] >= rec["reform_ms"] >= 0 and rec["handoff_ms"] >= 0
    (line,) = [e["message"] for e in events]
    assert line.startswith("membership: slow: worker 3 on node node-1 at 0.20x the others for 4 steps, below ")
    assert "retired as failed after step 6 in " in line and "nothing re-run" in line and line.endswith("world 4 -> 3")
    Recovery.model_validate(rec)  # what a step record's ``recoveries`` entry must be
    assert elastic.retire_slow(speeds, cfg.elastic, 7) == [], "a retired worker is no member: asked, not retired"


def test_the_world_stays_at_min_workers_and_says_why_once(tmp_path, profile):
    cfg, group, elastic, events = _elastic(tmp_path, profile, min_workers=3, retire_below_speed=0.5)
    speeds = FixedSpeeds({1: 0.3, 2: 0.25})
    (rec,) = elastic.retire_slow(speeds, cfg.elastic, 2)
    assert rec["lost"] == [2] and group.worker_ids == (0, 1, 3), "the slowest goes, down to min_workers"
    kept, retired = (e["message"] for e in events)
    assert kept == (
        "membership: worker 1 on node node-0 at 0.30x the others for 5 steps, below [elastic] retire_below_speed = "
        "0.5, but it stays: retiring it would leave 2 workers, below min_workers=3; the planner keeps planning "
        "around it"
    )
    assert retired.startswith("membership: slow: worker 2 on node node-1 at 0.25x")
    for after_step in (3, 4):
        assert elastic.retire_slow(speeds, cfg.elastic, after_step) == []
    assert len(events) == 2 and group.worker_ids == (0, 1, 3), "warned once; it stays"


# ---------------------------------------------------------------- the driver over the fake group, real speed estimate
def test_a_worker_at_a_fifth_of_the_pace_is_retired_and_every_document_is_trained_once(tmp_path, profile, corpus):
    # one worker per group (a forced layout: each worker's speed is measured alone, and the plans do not depend on
    # the solver's clock), so the estimate is exact: worker 3 reads 0.2 from its first observed step
    plan = {"mode": "static-ulysses-1", "tokens_per_worker": 128}
    elastic = {"min_workers": 2, "retire_below_speed": 0.3, "retire_after_steps": 2}
    cfg = _cfg(tmp_path, profile, steps=7, plan=plan, elastic=elastic)
    batches = _batches(cfg, 7)
    driver, group = fake_driver(cfg, corpus)
    group.set_speed(3, 0.2)
    try:
        # step 0 is a new world's first (left out), steps 1-3 observe it slow; its estimate is below 0.3 after 2 and 3
        ts = [driver.step() for _ in range(4)]
        assert all(t.recoveries == () for t in ts) and group.worker_ids == (0, 1, 2, 3)
        assert [r["speed"] for r in ts[-1].record["ranks"]] == [1.0, 1.0, 1.0, 0.2]
        t = driver.step()  # retired at this boundary: the step runs on the three left
        (rec,) = t.recoveries
        assert (t.ran, t.step, t.decisions) == (Ran.TRAINED, 4, ("Retire",))
        assert rec["what"] == "retire" and rec["lost"] == [3] and rec["world_after"] == [0, 1, 2]
        assert rec["slow"] == [{"worker": 3, "node": "node-1", "speed": 0.2}] and rec["after_step"] == 3
        assert rec["reason"].startswith("slow: worker 3 on node node-1 at 0.20x the others for 2 steps, below ")
        assert t.record["worker_ids"] == [0, 1, 2] and t.record["doc_ids"] == batches[4] and group.retired == [3]
        assert not rec["rerun"]
        events = driver.events.poll(0)[0]
        lines = [e["message"] for e in events if e["event"] == "progress" and "retired" in e["message"]]
        assert len(lines) == 1 and "retired as failed after step 3" in lines[0], lines
        ts = [driver.step() for _ in range(2)]  # a replacement starts on the freed slot and joins: the run goes on
        assert [t.record["step"] for t in ts] == [5, 6] and ts[-1].record["worker_ids"] == [0, 1, 2, 4]
        recs = read_records(cfg.run_dir + "/steps.jsonl", validate=True)
        assert [r["doc_ids"] for r in recs] == batches, "every batch trained once, in the stream's order"
        assert [[x["what"] for x in r["recoveries"]] for r in recs] == [[], [], [], [], ["retire"], ["grow"], []]
        _check_params(driver, corpus, cfg, batches)
    finally:
        driver.shutdown()
