"""A run that lost workers asks the cluster's autoscaler for them and withdraws the request once they are back
(``flexorch.control.capacity``, ``[elastic] request_capacity``): the decisions on their own, the real driver on the
fake worker group (a worker's node dies, a replacement node comes), and Ray's own SDK call against a real GCS."""

from __future__ import annotations

import json

import pytest

from flexorch.config import ConfigError, ElasticSettings
from flexorch.control.capacity import CapacityRequest, worker_bundle
from tests.fake_cluster import FakeWorkerGroup, Fault
from tests.paths import REPO
from tests.unit import test_driver_transitions as transitions
from tests.unit.test_driver_transitions import _batches, _cfg, _check_params

corpus, profile = transitions.corpus, transitions.profile  # the fake group's corpus and profile fixtures


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_it_asks_for_the_largest_world_it_had_while_smaller_and_withdraws_once_whole():
    asked, clock = [], _Clock()
    cap = CapacityRequest(worker_bundle(False), max_workers=4, request=asked.append, clock=clock)
    assert cap.update(4) is None and asked == []  # whole: nothing to ask
    event = cap.update(2)  # a node with two workers died
    assert asked == [[{"CPU": 1.0}] * 4] and event["missing"] == 2 and event["requested"] == 4
    assert event["message"] == "asked the cluster's autoscaler for 2 worker(s) to get back to 4 (CPU 1 each)"
    assert cap.update(2) is None and cap.update(3) is None and len(asked) == 1  # standing: not asked again
    clock.t += 42.5
    event = cap.update(4)
    assert asked[-1] == [] and event["waited_s"] == pytest.approx(42.5) and cap.requested == 0
    assert "back to 4 workers 42.5 s after asking the autoscaler; request withdrawn" in event["message"]
    cap.close()
    assert len(asked) == 2, "nothing standing: nothing to withdraw at the end"


def test_the_request_is_capped_at_max_workers_and_withdrawn_when_the_run_ends():
    asked = []
    cap = CapacityRequest(worker_bundle(True), max_workers=3, request=asked.append)
    cap.update(5)  # a world larger than max_workers (set lower on a resume) is wanted only up to max_workers
    assert cap.wanted == 3 and cap.update(2)["missing"] == 1
    assert asked == [[{"CPU": 1.0, "GPU": 1.0}] * 3]
    cap.close()
    assert asked[-1] == []


def test_request_capacity_takes_true_false_or_auto():
    assert ElasticSettings().request_capacity == "auto"
    for ok in (True, False, "auto"):
        ElasticSettings(request_capacity=ok)
    with pytest.raises(ConfigError, match="request_capacity must be true, false or 'auto'"):
        ElasticSettings(request_capacity="yes")


def test_the_driver_asks_for_a_lost_worker_and_withdraws_when_its_replacement_joined(tmp_path, profile, corpus):
    from flexorch.control.driver import TrainingDriver
    from flexorch.control.planner_client import LocalPlannerClient

    cfg = _cfg(tmp_path, profile, steps=5)
    batches = _batches(cfg, 5)
    asked = []
    group = FakeWorkerGroup(cfg, None, [Fault(3, "step", 1)])  # worker 3's node dies in step 1, its slot with it
    driver = TrainingDriver(
        cfg, worker_group=group, planner=LocalPlannerClient, corpus=corpus, capacity_request=asked.append
    )
    driver.setup()
    try:
        driver.step()
        driver.step()  # worker 3 lost: the step re-runs on 3 workers
        assert asked == []
        driver.step()  # at its boundary the world is 3 of 4: ask for the 4 workers' capacity
        assert asked == [[{"CPU": 1.0}] * 4]
        group.add_slots(1)  # the autoscaler's new node
        records = [driver.step().record for _ in range(2)]  # worker 4 starts on it, then joins
        assert asked[-1] == [], "withdrawn once the world is whole"
        (grow,) = [r for rec in records for r in rec["recoveries"] if r["what"] == "grow"]
        assert grow["joined"] == [4] and grow["capacity_wait_s"] >= 0
        events = [e for e in driver.poll(0)[0] if e["event"] == "capacity"]
        assert [e["requested"] for e in events] == [4, 0]
        _check_params(driver, corpus, cfg, batches)
    finally:
        driver.shutdown()
    assert len(asked) == 2


def test_a_run_on_its_own_fake_group_asks_nobody_unless_told_how():
    from flexorch.control.capacity import run_capacity

    cfg = _cfg_plain()
    assert run_capacity(cfg, object(), None) is None  # a given group on no cluster: 'auto' is off
    assert run_capacity(cfg.replace(elastic=ElasticSettings(request_capacity=True)), object(), None) is None
    assert run_capacity(cfg.replace(elastic=ElasticSettings(request_capacity=False)), None, print) is None
    assert isinstance(run_capacity(cfg, object(), print), CapacityRequest)


def _cfg_plain():
    from flexorch.config import TrainConfig

    return TrainConfig(workers=2, steps=1)


def test_ray_s_request_resources_is_what_an_autoscaler_reads_and_an_empty_one_clears_it(ray_cluster):
    # the real call (ray.autoscaler.sdk.request_resources) against this session's GCS: the autoscaler (v1 monitor)
    # reads its bundles from this key, so an autoscaler on the cluster sees the run's request and its withdrawal
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    from flexorch.control.capacity import ray_request

    ray_request([worker_bundle(False)] * 3)
    assert json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)) == [{"CPU": 1.0}] * 3
    ray_request([])
    assert json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)) == []


@pytest.mark.slow
def test_a_run_on_an_autoscaled_cluster_asks_for_its_workers_and_after_a_drain_grows_back_by_itself(tmp_path):
    # Ray's own autoscaler (v1 monitor, the fake multi-node provider: nodes are raylets on this machine), a head with
    # no CPU and no worker node: without the request the run could not start ("0 CPU slots"), or started with the
    # one worker a node launched for the corpus's Ray task holds; with it two nodes come, the workers start there,
    # and the request is withdrawn at the first step boundary. Then a node is drained for preemption: its worker
    # leaves at a boundary, the run asks again, the node goes, the autoscaler launches another, a worker starts
    # there and joins, and the request is withdrawn; losses and parameters of every step equal the single-process
    # reference. In a process of its own, with Ray's token authentication off as on that cluster: the suite's
    # shared Ray exports RAY_AUTH_MODE=token to this process, and a driver in token mode on a cluster without it
    # gets its actors "cancelled before it started running".
    import subprocess
    import sys

    out = tmp_path / "summary.json"
    subprocess.run(
        [sys.executable, "-m", "tests.capacity_scenario", str(tmp_path), str(out)],
        check=True, timeout=420, cwd=REPO,
    )  # fmt: skip
    summary = json.loads(out.read_text())
    sizes = summary["world_sizes"]
    assert sizes[:3] == [2, 2, 2] and summary["workers_on_new_nodes"] == 2, summary
    assert summary["first_requests"] == [2, 0], summary  # asked before the workers started, withdrawn once whole
    assert "of the 2 workers' slots: asked its autoscaler for them (CPU 1 each)" in summary["messages"][0]
    assert summary["standing_request_after_first_step"] == []
    # the drain: a planned leave at a boundary, nothing re-run, the world 1 until the new node's worker joined
    drain = summary["drain"]
    assert drain["what"] == "drain" and drain["reason"] == "preemption" and drain["fallback"] is None, summary
    assert len(drain["left"]) == 1 and drain["rerun"] is False, summary
    assert 2 in sizes[3:] and 1 in sizes[3:] and sizes[-1] == 2, sizes
    assert summary["victim_gone"] and summary["grew_back"] and summary["joined_on_new_node"], summary
    assert summary["requests"] == [2, 0, 2, 0], summary  # asked again after the leave, withdrawn once whole
    assert summary["standing_request_at_the_end"] == []
    assert any("back to 2 workers" in m for m in summary["messages"][2:]), summary["messages"]
    assert summary["reference_checked"]
