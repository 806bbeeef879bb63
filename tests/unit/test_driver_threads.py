"""The driver's thread rule, tested: the drain watch's thread reaches the driver only through ``StepPlans.without``,
under the step plans' lock, which the run loop's plans ahead take too (``control.step_plans``).

A thread stands in for the drain watch and asks for the smaller world's plan over and over while the real driver
steps on the in-process fake group with the in-process planner. The planner client's ``plan_ahead`` is watched: it
must never be entered by two threads at once (it is slowed down so that an unlocked path would overlap), every
smaller world's solve must be of the batch and world the run loop last asked for (the state is never seen torn),
nothing raises, and the losses are those of the same run without the watch's thread.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.fake_cluster import fake_driver
from tests.unit import test_driver_transitions as transitions
from tests.unit.test_driver_transitions import STATIC, _cfg

corpus, profile = transitions.corpus, transitions.profile  # the fake group's corpus and profile fixtures


class _Watched:
    """Wraps a planner client's ``plan_ahead``: counts the threads inside it at once, and checks each smaller world's
    solve against the last plan asked for ahead."""

    def __init__(self, driver):
        self.driver, self.inner = driver, driver.planner.plan_ahead
        self.inside, self.most, self.also, self.torn = 0, 0, 0, []
        self._count = threading.Lock()

    def __call__(self, step, lengths, n, *args, also=False, **kwargs):
        with self._count:
            self.inside += 1
            self.most = max(self.most, self.inside)
        try:
            time.sleep(0.005)  # widen the window an unlocked caller would overlap in
            if also:
                self.also += 1
                ahead = self.driver.plans.ahead
                if (ahead.step, ahead.lengths, ahead.n - 1) != (step, lengths, n):
                    self.torn.append((step, n, ahead.step, ahead.n))
            return self.inner(step, lengths, n, *args, also=also, **kwargs)
        finally:
            with self._count:
                self.inside -= 1


def _losses(cfg, corpus, drain_thread: bool) -> tuple[list[float], _Watched | None, dict]:
    driver, group = fake_driver(cfg, corpus)
    watched, out, stop = None, {"calls": 0, "errors": []}, threading.Event()

    def drain_watch() -> None:  # what control.drains' thread does when it sees worker 3's node draining
        while not stop.is_set():
            try:
                driver.plans.without([3])
                out["calls"] += 1
            except Exception as e:  # noqa: BLE001 - the test reports it
                out["errors"].append(e)
            time.sleep(0.001)

    thread = threading.Thread(target=drain_watch, daemon=True)
    try:
        if drain_thread:
            watched = _Watched(driver)
            driver.planner.plan_ahead = watched
            thread.start()
        records = [driver.step().record for _ in range(cfg.steps)]
    finally:
        stop.set()
        if drain_thread:
            thread.join(10)
        driver.shutdown()
    return [r["loss"] for r in records], watched, out


def test_the_drain_watch_s_plans_go_through_the_lock_while_steps_run(tmp_path, profile, corpus):
    cfg = _cfg(tmp_path / "a", profile, steps=5, plan=STATIC)
    alone, _, _ = _losses(cfg, corpus, drain_thread=False)
    losses, watched, out = _losses(_cfg(tmp_path / "b", profile, steps=5, plan=STATIC), corpus, drain_thread=True)
    assert out["errors"] == [], out["errors"]
    assert out["calls"] > 0 and watched.also > 0, "the watch's thread asked for the smaller world's plan"
    assert watched.most == 1, "two threads were inside the planner client's plan_ahead at once"
    assert watched.torn == [], "a smaller world's solve was not of the batch the run loop last asked for"
    assert losses == pytest.approx(alone, rel=0, abs=0), "the watch's thread changed what was trained"
