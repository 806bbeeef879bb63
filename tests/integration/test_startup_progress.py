"""Start-up on a slow machine: workers that are slow to start are waited for, with progress published; a start fails
only for a real reason (no slot, the worker's own error, no progress at all), and says which.

The worker actors here are stand-ins started through ``RayWorkerGroup.worker_class`` (the seam for this): their
constructor is busy (like importing torch on a loaded machine), idle (hung) or raises, and they answer ``info`` and
one ``slow`` call. The suite's shared local Ray (``conftest.ray_cluster``, ``tests.ray_env.SHARED_CPUS`` slots).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from flexorch.control import settle
from flexorch.control.failures import MembershipFailure, WorkerGroupError
from flexorch.control.worker_group import RayWorkerGroup
from tests.ray_env import SHARED_CPUS


def stand_in(busy_s: float = 0.0, idle_s: float = 0.0, fail: str | None = None):
    """A worker actor class whose constructor burns CPU for ``busy_s``, then sleeps ``idle_s``, then raises
    ``ImportError(fail)`` when ``fail`` is given. Built in a function so Ray pickles it by value."""
    import ray

    @ray.remote
    class StandIn:
        def __init__(self, worker_id, *args):
            end = time.monotonic() + busy_s
            while time.monotonic() < end:
                pass
            time.sleep(idle_s)
            if fail:
                raise ImportError(fail)
            self.worker_id = worker_id

        def info(self) -> dict:
            return {"worker_id": self.worker_id, "pid": os.getpid()}

        def slow(self, seconds: float) -> int:
            time.sleep(seconds)
            return self.worker_id

        # the control-thread calls the group makes on every worker actor (``workers.actor.Worker``): a stand-in
        # does not beat (never judged silent), holds no world to abort and nothing to freeze
        def start_heartbeat(self, host: str, port: int) -> None:
            pass

        def stop_heartbeat(self, timeout_s: float = 5.0) -> bool:
            return True

        def abort_world(self, epoch: int | None = None) -> int:
            return 0

        def retire(self) -> int:
            return 0

    return StandIn


def group(n: int, events: list, **kw) -> RayWorkerGroup:
    return RayWorkerGroup(n, model_cfg={}, optim_cfg={}, seed=0, publish=events.append, **kw)


def messages(events: list) -> list[str]:
    assert all(e["event"] == "progress" for e in events)
    return [e["message"] for e in events]


@pytest.mark.slow
def test_a_worker_slow_to_start_is_waited_for_with_progress(ray_cluster, monkeypatch):
    # each constructor is busy for 3x the no-progress limit: the old fixed deadline counted both workers missing
    monkeypatch.setattr(RayWorkerGroup, "worker_class", stand_in(busy_s=9.0))
    events = []
    t0 = time.monotonic()
    g = group(2, events, placement_timeout_s=3.0)
    try:
        assert time.monotonic() - t0 > 3.0, "the start must outlast the no-progress limit for this test to mean much"
        assert g.size == 2 and not g.joining and not g.start_failures
        said = messages(events)
        assert said[0].startswith("starting workers: 0 of 2 ready after 0 s (2 still starting")
        assert any("loading (pid" in m and "s CPU)" in m for m in said), said
        assert said[-1].startswith("starting workers: 2 of 2 ready after")
    finally:
        g.shutdown()


@pytest.mark.slow
def test_a_worker_that_makes_no_progress_is_given_up_and_named(ray_cluster, monkeypatch):
    monkeypatch.setattr(RayWorkerGroup, "worker_class", stand_in(idle_s=120.0))
    events = []
    with pytest.raises(WorkerGroupError) as err:
        group(1, events, placement_timeout_s=3.0)
    msg = str(err.value)
    assert msg.startswith("only 0 of 1 workers started after"), msg
    assert "worker 0 made no progress for 3 s (last seen: loading (pid" in msg, msg
    assert "Nothing progressed for 3 s" in msg, msg


def test_more_workers_than_slots_fails_at_once_naming_the_numbers(ray_cluster, monkeypatch):
    monkeypatch.setattr(RayWorkerGroup, "worker_class", stand_in())
    events = []
    n = SHARED_CPUS
    with pytest.raises(WorkerGroupError, match=rf"the Ray cluster has {n} CPU slots, the run needs at least {n + 1} "):
        group(n + 1, events)
    assert events == [], "nothing was started"


def test_slots_held_by_others_fail_as_no_slot(ray_cluster, monkeypatch):
    import ray

    @ray.remote(num_cpus=SHARED_CPUS)
    class Hog:
        def ready(self) -> bool:
            return True

    hog = Hog.remote()
    ray.get(hog.ready.remote())
    monkeypatch.setattr(RayWorkerGroup, "worker_class", stand_in())
    events = []
    try:
        with pytest.raises(WorkerGroupError) as err:
            group(1, events, placement_timeout_s=2.0)
    finally:
        ray.kill(hog)
    msg = str(err.value)
    assert "worker 0 waited 2 s for a CPU slot" in msg, msg
    assert f"The cluster has {SHARED_CPUS} CPU slots, 0 free" in msg and "1 are needed" in msg, msg
    assert any("pending a CPU slot (none free)" in m for m in messages(events)), events


def test_a_failed_start_gives_the_workers_own_error(ray_cluster, monkeypatch):
    monkeypatch.setattr(RayWorkerGroup, "worker_class", stand_in(fail="No module named 'flexorch_missing_dep'"))
    events = []
    with pytest.raises(WorkerGroupError) as err:
        group(2, events)  # the no-progress limit stays 60 s: a failed start is not waited for
    msg = str(err.value)
    assert "failed to start: ImportError: No module named 'flexorch_missing_dep'" in msg, msg
    assert "The worker processes could not be created" in msg, msg


def test_a_long_setup_call_publishes_who_is_still_working(ray_cluster, monkeypatch):
    monkeypatch.setattr(RayWorkerGroup, "worker_class", stand_in())
    events = []
    g = group(2, events)
    try:
        monkeypatch.setattr(settle, "PROGRESS_EVERY_S", 0.5)  # the wait on calls (control.settle)
        events.clear()
        slow = g.actor(1).slow.remote(3.0)
        got = g.call_all({0: g.actor(0).slow.remote(0.0), 1: slow}, "form a world", 60.0)
        assert got == {0: 0, 1: 1}
        said = messages(events)
        assert said and all(m.startswith("waiting for workers (form a world): ") for m in said), said
        assert any("1 of 2 done after" in m and "still working: workers [1]" in m for m in said), said
        events.clear()
        g.settle({0: g.actor(0).slow.remote(1.5)}, 60.0)  # a step's settle (no ``what``) stays quiet
        assert events == []
    finally:
        g.shutdown()


def test_a_call_that_outlasts_its_limit_says_so_rather_than_lost(ray_cluster, monkeypatch):
    # calibration's one probe call on 2 cores outlasted collective_timeout_s + 30 s; its busy workers were killed
    # and reported as "lost workers [0, 1, 2, 3]", which reads like a crash
    monkeypatch.setattr(RayWorkerGroup, "worker_class", stand_in())
    g = group(2, [])
    try:
        with pytest.raises(MembershipFailure) as e:
            g.call_all({0: g.actor(0).slow.remote(0.0), 1: g.actor(1).slow.remote(60.0)}, "probe", 1.5)
        assert e.value.failure.timed_out == {1} and e.value.failure.lost == {1}
        assert str(e.value) == "could not probe: workers [1] did not finish within its limit of 1.5 s and were killed"
    finally:
        g.shutdown()


def test_corpus_loading_reports_its_phases(ray_cluster, tmp_path):
    from flexorch.config import CorpusConfig
    from flexorch.data.corpus import load_corpus

    for i in range(3):
        (tmp_path / f"doc{i}.txt").write_text(f"document number {i}\n")
    events = []
    corpus = load_corpus(CorpusConfig(source=str(tmp_path), max_context=64), publish=events.append)
    said = messages(events)
    assert said[0] == "loading the corpus: listing the source"
    assert f"loading the corpus: preparing 3 text files under {tmp_path}" in said
    assert any(m.startswith("preparing the corpus into ") and "1 blocks" in m for m in said), said
    assert any(m.startswith("preparing the corpus: 1/1 blocks") and "tokens/s), ETA" in m for m in said), said
    assert any(m.startswith("prepared the corpus: 3 documents") for m in said), said
    assert said[-1].startswith(f"loaded the corpus: 3 documents, {int(corpus.lengths.sum())} tokens in")
    events.clear()  # a second start: the store is found by its fingerprints and opened, nothing prepared
    load_corpus(CorpusConfig(source=str(tmp_path), max_context=64), publish=events.append)
    said = messages(events)
    assert said == ["loading the corpus: listing the source", said[-1]] and said[-1].startswith(
        "opened the corpus store: 3 documents"
    )


def test_progress_phases_tick_while_a_phase_runs():
    from flexorch.data.corpus import progress_phases

    events = []
    with progress_phases(events.append, "doing it", every_s=0.0) as phase:
        phase("the slow part")
        deadline = time.monotonic() + 30.0
        while len(events) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
    said = messages(events)
    assert said[0] == "doing it: the slow part"
    assert said[1].startswith("doing it: the slow part (") and said[1].endswith(" s so far)")
    with progress_phases(None, "silent") as phase:
        phase("nothing is published and no thread runs")


class _ProbeGroup:
    """Workers answering calibration calls with timings from a known cost (no Ray, no model)."""

    def __init__(self, size: int = 2) -> None:
        self.size = size

    def rank_nodes(self) -> list[str | None]:
        return ["node-0"] * self.size  # one node: no probe across a node boundary

    def call(self, method: str, *args) -> list:
        if method == "activation_bytes_per_token":
            return [1000.0] * self.size
        assert method == "probe"
        ms = [0.5 + sum(1e-5 * s * s + 1e-3 * s for s in p.lengths) / p.degree + 0.2 * (p.degree > 1) for p in args[0]]
        return [ms] * self.size


def test_calibration_publishes_its_phases(tmp_path, monkeypatch):
    from flexorch.control import calibration_probes
    from flexorch.control.calibration import calibrate
    from tests.train_helpers import train_config

    cfg = train_config(tmp_path, tmp_path / "run", tmp_path / "unused.json", plan={"profile": "auto"})
    events = []
    profile, report = calibrate(_ProbeGroup(), cfg, repeats=1, publish=events.append)
    said = messages(events)
    assert said[0].startswith("calibrating the cost model on 2 workers: ") and "runs each" in said[0], said
    assert said[1].startswith("calibrating: probes done after"), said
    assert np.isfinite(report["median_rel_error"]) and profile.a2_ms > 0
    events.clear()
    monkeypatch.setattr(calibration_probes, "PROGRESS_EVERY_S", 0.0)  # a slow machine: progress at every probe
    calibrate(_ProbeGroup(), cfg, repeats=1, publish=events.append)
    said = messages(events)
    n = len(report["probes"])
    ticks = [m for m in said if m.startswith("calibrating: probe ")]
    assert len(ticks) == n and ticks[-1].startswith(f"calibrating: probe {n} of {n} (") and " s" in ticks[-1], said


def test_calibration_probes_stay_within_the_longest_document_the_data_holds():
    from flexorch.control.calibration_probes import calibration_probes

    compute, groups = calibration_probes(4096, 4, ("ulysses", "ring"), max_context=512)
    uncapped = calibration_probes(4096, 4, ("ulysses", "ring"))[1]
    assert max(max(p.lengths) for p in compute + groups) == 512
    assert max(max(p.lengths) for p in uncapped) == 16384  # what timed out on 2 cores
    # a group probe still moves a full micro-batch's tokens, as documents of at most max_context
    moved = [(p.degree, p.kind, sum(p.lengths)) for p in groups]
    assert moved == [(p.degree, p.kind, sum(p.lengths)) for p in uncapped]
    assert all(max(p.lengths) - min(p.lengths) <= 1 for p in groups)


def test_calibration_probes_are_cut_to_a_bounded_run_and_the_fit_still_holds(tmp_path, monkeypatch):
    # a device-sized budget (an H200's ~870K tokens at full recompute) made packed probes of 435K tokens, 100 s each;
    # each probe is now cut to its share of PROBES_S a run, predicted from the largest probe of its degree so far
    from flexorch.control import calibration_probes
    from flexorch.data.corpus import CorpusConfig
    from tests.train_helpers import train_config

    plan = {"profile": "auto", "tokens_per_worker": 8192}
    cfg = train_config(
        tmp_path, tmp_path / "run", tmp_path / "unused.json", plan=plan, data=CorpusConfig(max_context=4096)
    )
    _, whole = calibrate_report(cfg)
    # every probe runs twice here: 50 ms a run; the fake's 4096-token document takes ~172 ms
    monkeypatch.setattr(calibration_probes, "PROBES_S", 0.05 * 2 * len(whole["probes"]))
    monkeypatch.setattr(calibration_probes, "MIN_RUN_S", 0.01)
    profile, cut = calibrate_report(cfg)
    largest = max(sum(p["seq_lengths"]) for p in whole["probes"])
    assert max(sum(p["seq_lengths"]) for p in cut["probes"]) < largest / 2
    assert len(cut["probes"]) == len(whole["probes"])  # every probe still runs, smaller
    # probes after the first of their degree are kept near the bound (the fake's cost is exact, so it fits exactly)
    assert max(p["ms"] for p in cut["probes"]) < 2 * 50
    assert profile.a1_ms == pytest.approx(1e-5, rel=0.05) and profile.a2_ms == pytest.approx(1e-3, rel=0.05)
    assert cut["median_rel_error"] < 0.01
    said = f"probes cut to about 0.05 s a run ({0.1 * len(whole['probes']):g} s in all)"
    assert said in cut["message"] and "cut to" not in whole["message"]
    # the fake's collectives cost no bytes: their bandwidths are clamped, said as a note (nothing to act on)
    assert "\nnote: ulysses-2: bandwidth inf GB/s clamped" in cut["message"] and "warning" not in cut["message"]


def calibrate_report(cfg):
    from flexorch.control.calibration import calibrate

    return calibrate(_ProbeGroup(), cfg, repeats=1)


def test_a_calibration_probe_that_outlasts_the_call_limit_is_a_clear_error(tmp_path):
    from flexorch.control.calibration import calibrate
    from flexorch.control.calibration_probes import CalibrationTimeoutError, calibration_probes
    from flexorch.control.failures import Failure
    from tests.train_helpers import train_config

    class TooSlow(_ProbeGroup):
        def call(self, method: str, *args) -> list:
            if method == "probe" and args[0][0].degree > 1:
                failure = Failure(frozenset({0, 1}), timed_out=frozenset({0, 1}))
                raise MembershipFailure("probe", failure, 150.0)
            return super().call(method, *args)

    cfg = train_config(tmp_path, tmp_path / "run", tmp_path / "unused.json", plan={"profile": "auto"})
    with pytest.raises(CalibrationTimeoutError) as e:
        calibrate(TooSlow(), cfg, repeats=1)
    msg = str(e.value)
    compute, _ = calibration_probes(cfg.tokens_per_worker, 2, cfg.plan.kinds, max_context=cfg.data.max_context)
    assert msg.startswith(f"calibration probe {len(compute) + 1} of "), msg  # the first group probe
    assert "each worker in ulysses groups of 2, 2 runs)" in msg, msg
    assert "workers [0, 1] did not finish within its limit of 150 s" in msg and "collective_timeout_s" in msg, msg


def test_one_worker_calibrates_without_warnings_about_groups_it_cannot_form(tmp_path):
    # a one-worker GPU run warned "ulysses-2: bandwidth inf GB/s clamped": the a2a table's placeholder entry, for
    # a group the run can never form, was fitted and reported like a measurement
    from flexorch.control.calibration import calibrate
    from tests.train_helpers import train_config

    plan = {"profile": "auto", "tokens_per_worker": 256}
    cfg = train_config(tmp_path, tmp_path / "run", tmp_path / "unused.json", plan=plan, workers=1)
    profile, report = calibrate(_ProbeGroup(size=1), cfg, repeats=1)
    assert "ulysses-2" not in report["message"] and "ulysses-2" not in report["group_fit"], report["message"]
    assert profile.a2_ms > 0 and 2 in profile.a2a_gbps  # the placeholder entry is still there for the planner
