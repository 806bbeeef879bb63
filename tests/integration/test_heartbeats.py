"""The driver's heartbeat watch (``flexorch.control.heartbeats``) on a real TCPStore, beaten as a worker's thread
does (``Worker.start_heartbeat``: ``add("beat/<id>", 1)`` from another client); the clock is ``time.monotonic``,
patched so that silence is measured without sleeping."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from flexorch.control import heartbeats as hb


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(hb.time, "monotonic", lambda: now[0])
    return now


def _beat(watch: hb.Heartbeats, worker_id: int) -> None:
    client = dist.TCPStore(watch.host, watch.port, is_master=False)
    client.add(f"beat/{worker_id}", 1)


def test_a_silent_worker_is_named_after_the_limit_and_a_beating_one_never(clock):
    watch = hb.Heartbeats("127.0.0.1", timeout_s=10.0)
    for w in (1, 2):
        _beat(watch, w)
    assert watch.silent({1, 2, 3}) == {}  # counts first seen now; worker 3 never beat: not judged
    clock[0] += 6.0
    _beat(watch, 1)
    assert watch.silent({1, 2, 3}) == {}
    clock[0] += 5.0  # worker 2 silent 11 s, worker 1 beat 5 s ago
    assert watch.silent({1, 2, 3}) == {2: pytest.approx(11.0)}
    assert watch.beating(1) and not watch.beating(2) and not watch.beating(3)
    assert watch.silent({1, 2}, limit_s=3.0) == {1: pytest.approx(5.0), 2: pytest.approx(11.0)}  # a broken world


def test_detection_measures_from_the_last_beat_and_says_by_what(clock):
    watch = hb.Heartbeats("127.0.0.1", timeout_s=10.0)
    _beat(watch, 4)
    watch.silent({4})  # the count first seen at t = 1000
    failed_at = clock[0] + 2.5
    clock[0] += 4.0  # the recovery asks 1.5 s after the failure was seen
    got = watch.detection([4], failed_at, silent={})
    assert got == {"by": "ray", "detect_ms": pytest.approx(2500.0), "since_ms": pytest.approx(1500.0)}
    assert watch.detection([4], failed_at, silent={4: 11.0})["by"] == "heartbeat"
    assert watch.detection([4], None, silent={}) is None  # no failure seen
    assert watch.detection([9], failed_at, silent={}) is None  # never heard from


def test_an_unwatched_run_calls_nobody_beating():
    watch = hb.Heartbeats("127.0.0.1", timeout_s=0)
    _beat(watch, 1)
    assert not watch.beating(1)


def _beats(watch: hb.Heartbeats, worker_id: int, at_least: int) -> int:
    deadline = time.monotonic() + 30.0
    while (n := watch.counts({worker_id})[worker_id]) < at_least:
        assert time.monotonic() < deadline, "the worker never beat"
        time.sleep(0.02)
    return n


def test_a_stopped_heartbeat_stops_and_the_store_closes_without_a_trace_on_the_worker(capfd):
    # at the end of a run the driver dropped the store while the workers still beat: each beat's c10d error printed
    # a C++ stack trace on the worker, which Ray forwarded to the console of a run that went well
    import gc

    from flexorch.workers.actor import Worker

    watch = hb.Heartbeats("127.0.0.1", timeout_s=10.0)
    worker = Worker(7, {}, {}, 0, num_threads=0, use_gpu=False)
    worker.start_heartbeat(watch.host, watch.port, period_s=0.02)
    _beats(watch, 7, at_least=3)
    assert worker.stop_heartbeat() is True
    n = watch.counts({7})[7]
    time.sleep(0.1)
    assert watch.counts({7})[7] == n, "a stopped heartbeat still beats"
    del watch
    gc.collect()  # the master store closes
    time.sleep(0.2)
    assert "TCPStore" not in capfd.readouterr().err
    assert worker.stop_heartbeat() is True  # again: nothing to stop


def _quiet_worker_class():
    """A worker actor class that beats once (``start_heartbeat``) and then never again, as a worker whose heartbeat
    thread a loaded machine starves; ``fail`` raises its own error (a bug), ``slow`` answers after a while. Built in
    a function so Ray pickles it by value."""
    import ray

    @ray.remote
    class Quiet:
        def __init__(self, worker_id, *args):
            self.worker_id = worker_id

        def info(self) -> dict:
            return {"worker_id": self.worker_id}

        def start_heartbeat(self, host: str, port: int) -> None:
            dist.TCPStore(host, port, is_master=False).add(f"beat/{self.worker_id}", 1)

        def fail(self) -> None:
            raise RuntimeError("a bug of its own")

        def slow(self, seconds: float) -> int:
            time.sleep(seconds)
            return self.worker_id

        # the rest of the control-thread calls the group makes on every worker actor (``workers.actor.Worker``)
        def stop_heartbeat(self, timeout_s: float = 5.0) -> bool:
            return True

        def abort_world(self, epoch: int | None = None) -> int:
            return 0

        def retire(self) -> int:
            return 0

    return Quiet


@pytest.mark.slow
def test_after_a_workers_own_error_a_peer_that_missed_beats_is_waited_for_not_killed(ray_cluster, monkeypatch):
    # a bug stops the run, and the peers hold the state its emergency checkpoint is written from: a peer whose
    # beats stopped for more than the broken-world silence (3 s) but less than heartbeat_timeout_s, answering
    # within the error grace, is kept (CI, a loaded machine: one was killed, its shard lost, no checkpoint)
    import ray

    from flexorch.control import worker_group as wg
    from flexorch.control.settle import BROKEN_WORLD_SILENCE_S

    monkeypatch.setattr(wg.RayWorkerGroup, "worker_class", _quiet_worker_class())
    g = wg.RayWorkerGroup(2, model_cfg={}, optim_cfg={}, seed=0, heartbeat_timeout_s=10.0)
    try:
        ray.get([g.actor(w).start_heartbeat.remote(g.host, g.heartbeats.port) for w in g.worker_ids])
        g.heartbeats.silent(set(g.worker_ids))  # the counts first seen now
        quiet = BROKEN_WORLD_SILENCE_S + 2.0
        results, failure = g.settle({0: g.actor(0).fail.remote(), 1: g.actor(1).slow.remote(quiet)}, 60.0)
        assert results == {1: 1}, "the quiet peer answered and was not killed"
        assert failure.lost == frozenset() and [w for w, _ in failure.errors] == [0], failure
        assert g.worker_ids == (0, 1) and ray.get(g.actor(1).info.remote())["worker_id"] == 1
    finally:
        g.shutdown()
