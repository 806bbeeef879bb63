"""Workers that run slow, in the control plane (``flexorch.control.speed_watch``): the real ``TrainingDriver`` over the
in-process fake group (``tests.fake_cluster``: a slow worker's groups take their cost-model time over its speed) and
the in-process planner (real MILP solves), no Ray.

With one of 4 workers at 0.4x, the driver's plans give it a smaller share of the tokens after a few steps and the
console says so once; set back to 1.0x, its share is back within 3 steps and the console says that once; with
``[plan] speeds = "blind"`` its share does not move. Each record's rank entries name the worker's speed, node and
process id. Also: the accelerator-kind seeds from Ray's node list, the planner's topology with speeds (one node and
several), the plan asked ahead for other speeds than the plan taken (solved again), the config switch, the metric.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

from flexorch.cli.train_console import print_event
from flexorch.config import (
    ConfigError,
    CorpusConfig,
    ElasticSettings,
    ModelConfig,
    OptimConfig,
    PipelineSettings,
    PlanSettings,
    TrainConfig,
)
from flexorch.control.planner_client import LocalPlannerClient, PlannerSpec
from flexorch.control.speed_watch import SpeedWatch, accelerator_kinds, kind_seeds
from flexorch.control.step_plans import StepPlans
from flexorch.records.metrics import RunMetrics
from flexorch.records.writer import read_records
from flexorch.solver.planner_config import PlannerConfig
from flexorch.solver.topology import Topology
from flexorch.solver.worker_speeds import seed_speeds
from tests.fake_cluster import FakeWorkerGroup, fake_driver, memory_corpus
from tests.solver_helpers import TINY
from tests.train_helpers import cpu_profile

LENGTHS = [5, 40, 120, 17, 90, 64, 127, 60, 8, 33, 128, 71, 12, 50, 99, 3, 110, 45, 64, 22, 100, 7, 30, 55]
SLOW, SLOW_FROM, FAST_FROM, STEPS = 0, 1, 7, 11
"""Worker 0 runs at 0.4x from step 1 and at 1.0x again from step 6, of 10 steps."""


@pytest.fixture(scope="module")
def corpus():
    rng = np.random.default_rng(0)
    return memory_corpus([rng.integers(1, 257, n) for n in LENGTHS], vocab_size=257)


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return cpu_profile(tmp_path_factory.mktemp("profile") / "profile.json")


def _cfg(run_dir, profile, speeds: str = "aware", **kw) -> TrainConfig:
    # 128 tokens per worker: every document fits one worker, so each rank's time is its own (no group to untangle)
    plan = {"profile": str(profile), "tokens_per_worker": 128, "time_limit_s": 0.03, "timeout_s": 5.0, "speeds": speeds}
    return TrainConfig(
        steps=STEPS, workers=4, batch_size=6, run_dir=str(run_dir), model=ModelConfig(),
        optim=OptimConfig(lr=1e-3, warmup_steps=1), data=CorpusConfig(source="memory", max_context=128),
        plan=PlanSettings(**plan), elastic=ElasticSettings(wait_s=2.0), **kw,
    )  # fmt: skip


def _run(tmp_path_factory, corpus, profile, speeds: str) -> tuple[list[dict], list[dict], dict]:
    """A run of ``STEPS`` steps on 4 workers of one node, worker ``SLOW`` at 0.4x from ``SLOW_FROM`` to
    ``FAST_FROM``: (the records as written, the speed events, what the watch said at the slowest point)."""
    cfg = _cfg(tmp_path_factory.mktemp(speeds) / "run", profile, speeds)
    driver, group = fake_driver(cfg, corpus, per_node=4)  # one node: planned as Topology.single(4) with speeds
    seen = {}
    try:
        group.set_speed(SLOW, 1.0)  # modelled times from the start
        for step in range(STEPS):
            if step == SLOW_FROM:
                group.set_speed(SLOW, 0.4)
            if step == FAST_FROM:
                seen["slow_workers"] = driver.speeds.slow_workers(0.5, 3)
                seen["estimate"] = driver.speeds.estimate(SLOW)
                group.set_speed(SLOW, 1.0)
            driver.step()
        seen["after"] = driver.speeds.slow_workers(0.5, 3)
        events = [e for e in driver.events.poll(0)[0] if e["event"] == "speed"]
    finally:
        driver.shutdown()
    return read_records(cfg.run_dir + "/steps.jsonl", validate=True), events, seen


@pytest.fixture(scope="module")
def aware(tmp_path_factory, corpus, profile):
    return _run(tmp_path_factory, corpus, profile, "aware")


@pytest.fixture(scope="module")
def blind(tmp_path_factory, corpus, profile):
    return _run(tmp_path_factory, corpus, profile, "blind")


def _share(record: dict, worker: int) -> float:
    """The share of the step's tokens the worker computed."""
    tokens = [entry["local_tokens"] for entry in record["ranks"]]
    return tokens[record["worker_ids"].index(worker)] / sum(tokens)


def _plan_speeds(record: dict) -> list[float] | None:
    return (record["plan"].get("topology") or {}).get("speeds")


def test_a_slow_worker_gets_less_work_and_one_console_line(aware, blind):
    records, events, seen = aware
    # two slow steps move the median of 3; the plan asked ahead while the second ran had the speeds of before it,
    # but a worker gone slow is planned for at once (solved again: its speed moved by more than SPEED_MOVE)
    slow_steps = range(SLOW_FROM + 2, FAST_FROM)
    shares = [_share(records[s], SLOW) for s in slow_steps]
    blind_shares = [_share(blind[0][s], SLOW) for s in slow_steps]
    assert np.mean(shares) < 0.8 * 0.25 and np.mean(shares) < np.mean(blind_shares) - 0.05, (shares, blind_shares)
    for s in slow_steps:
        speeds = _plan_speeds(records[s])
        assert speeds is not None and speeds[SLOW] < 0.8 and all(v == 1.0 for v in np.delete(speeds, SLOW)), speeds
    drops = [e for e in events if e["slow"]]
    assert [e["worker"] for e in drops] == [SLOW], events  # once, and for the slow worker alone
    assert drops[0]["node"] == "node-0" and drops[0]["speed"] < 0.8
    assert "worker 0" in drops[0]["message"] and "planning around it" in drops[0]["message"]
    out = io.StringIO()
    print_event(drops[0], _cfg("run", "p"), out)
    assert out.getvalue() == drops[0]["message"] + "\n"
    assert seen["slow_workers"] == [SLOW] and seen["estimate"] < 0.5


def test_a_recovered_worker_gets_its_share_back_within_3_steps(aware):
    records, events, seen = aware
    back = FAST_FROM + 2  # the third step at full speed
    for rec in records[back:]:
        assert _plan_speeds(rec) is None and _share(rec, SLOW) >= 0.2, (rec["step"], _plan_speeds(rec))
    ups = [e for e in events if not e["slow"]]
    assert [e["worker"] for e in ups] == [SLOW] and ups[0]["speed"] >= 0.8, events
    assert "back to" in ups[0]["message"]
    assert events.index(ups[0]) > events.index(next(e for e in events if e["slow"]))
    assert seen["after"] == []


def test_a_blind_run_measures_but_plans_at_one_speed(blind):
    records, events, _ = blind
    assert all(_plan_speeds(rec) is None for rec in records)
    assert min(rec["ranks"][SLOW]["speed"] for rec in records) < 0.8  # measured and recorded all the same
    assert any(e["slow"] and e["worker"] == SLOW for e in events)  # and said on the console
    shares = [_share(records[s], SLOW) for s in range(SLOW_FROM + 2, FAST_FROM)]
    assert np.mean(shares) >= 0.2, shares  # its share does not move


def test_each_rank_entry_names_its_speed_node_and_pid(aware):
    records, _, _ = aware
    for rec in records:
        assert [e["node"] for e in rec["ranks"]] == ["node-0"] * 4
        assert [e["pid"] for e in rec["ranks"]] == [os.getpid()] * 4
        assert all(isinstance(e["speed"], float) and e["speed"] == round(e["speed"], 3) for e in rec["ranks"])
    assert records[0]["ranks"][SLOW]["speed"] == 1.0 and records[FAST_FROM - 1]["ranks"][SLOW]["speed"] < 0.8


# ---------------------------------------------------------------------------------------------- the parts


def test_the_config_switch():
    assert PlanSettings().speeds == "aware" and PlanSettings(speeds="blind").speeds == "blind"
    with pytest.raises(ConfigError, match=r"plan.speeds must be 'aware' or 'blind', got 'fast'"):
        PlanSettings(speeds="fast")


RAY_NODES = [
    {"NodeID": "a", "Resources": {"CPU": 16.0, "GPU": 4.0, "accelerator_type:A100": 1.0}},
    {"NodeID": "b", "Resources": {"CPU": 16.0, "GPU": 4.0, "accelerator_type:H100": 1.0}},
    {"NodeID": "c", "Resources": {"CPU": 8.0}},
]


def test_accelerator_kinds_come_from_each_workers_node():
    node_of = {0: "a", 1: "a", 2: "b", 3: "c", 4: "gone"}
    assert accelerator_kinds(node_of, RAY_NODES) == {0: "A100", 1: "A100", 2: "H100", 3: None, 4: None}
    mixed = {0: "a", 1: "a", 2: "b", 3: "b"}
    seeds = kind_seeds(mixed, RAY_NODES)
    assert seeds == seed_speeds(accelerator_kinds(mixed, RAY_NODES)) and seeds[2] > seeds[0]
    assert kind_seeds({0: "a", 1: "a", 2: "c"}, RAY_NODES) == {}, "one kind (and CPU nodes): no seeds"


class _Nodes:
    """What ``SpeedWatch.for_run`` asks of a worker group."""

    def __init__(self, node_of):
        self.node_of = node_of

    def nodes_of(self):
        return self.node_of


def test_gpu_workers_are_seeded_from_their_kinds_and_cpu_workers_never(monkeypatch, tmp_path):
    import ray

    monkeypatch.setattr(ray, "nodes", lambda: RAY_NODES)
    group = _Nodes({0: "a", 1: "a", 2: "b", 3: "b"})
    watch = SpeedWatch.for_run(_cfg(tmp_path, "p", use_gpu=True), group, print)
    assert watch.estimate(2) == pytest.approx(seed_speeds({0: "A100", 1: "A100", 2: "H100", 3: "H100"})[2])
    assert watch.estimate(2) > watch.estimate(0)
    monkeypatch.setattr(ray, "nodes", lambda: pytest.fail("CPU workers: Ray's nodes are never asked"))
    cpu = SpeedWatch.for_run(_cfg(tmp_path, "p", speeds="blind"), group, print)
    assert cpu.estimate(2) == 1.0 and not cpu.aware


def test_the_planning_topology_carries_the_ranks_speeds():
    watch = SpeedWatch(print, seeds={3: 0.5})
    two = Topology((2, 2), ("n0", "n1"))
    assert watch.planning_topology(None, 4, [0, 1, 2, 3]) == Topology.single(4).with_speeds((1.0, 1.0, 1.0, 0.5))
    assert watch.planning_topology(two, 4, [0, 1, 2, 3]).speeds == (1.0, 1.0, 1.0, 0.5)
    assert watch.planning_topology(two, 4, [3, 0, 1, 2]).speeds == (0.5, 1.0, 1.0, 1.0)
    assert watch.planning_topology(two, 4, [0, 1, 2]) is two, "joiners not admitted: their ranks are not known"
    assert watch.planning_topology(None, 3, [0, 1, 2]) is None, "every rank at 1.0: planned as before"
    assert SpeedWatch(print, aware=False, seeds={3: 0.5}).planning_topology(two, 4, [0, 1, 2, 3]) is two


def test_step_plans_ask_for_speeds_in_sp_runs_only(tmp_path, profile, corpus):
    cfg = _cfg(tmp_path / "run", profile)
    group = FakeWorkerGroup(cfg)  # 2 nodes of 2
    plans = StepPlans(corpus, group)
    plans.use(cfg, planner=None, speeds=SpeedWatch(print, seeds={1: 0.5}))
    assert plans.topology(4) == Topology((2, 2), ("node-0", "node-1"), (1.0, 0.5, 1.0, 1.0))
    assert plans.topology(2, without=[0, 1]) is None, "the rest on one node, all at 1.0"
    assert plans.topology(3, without=[2]).speeds == (1.0, 0.5, 1.0)
    plans.use(cfg.replace(pipeline=PipelineSettings(stages=2)), planner=None, speeds=plans.speeds)
    assert plans.topology(4) == Topology((2, 2), ("node-0", "node-1")), "pipelined steps: one speed"


def test_a_plan_asked_ahead_for_other_speeds_is_solved_again():
    spec = PlannerSpec(profile=TINY, config=PlannerConfig(time_limit_s=0.2, isolate=False), static=None,
                       pipeline_stages=1, pipeline_params="stage", timeout_s=5.0)  # fmt: skip
    client = LocalPlannerClient(spec, print)
    lengths = [10, 20, 150, 5, 60, 90]
    try:
        ahead = Topology.single(4).with_speeds((1.0, 1.0, 1.0, 0.5))
        client.plan_ahead(7, lengths, 4, topology=ahead)
        taken = Topology.single(4).with_speeds((1.0, 1.0, 1.0, 0.25))
        planned = client.plan(7, lengths, 4, topology=taken)
        assert planned.fallback_reason is None and planned.plan.topology == taken
        client.plan_ahead(8, lengths, 4, topology=ahead)
        planned = client.plan(8, lengths, 4, topology=None)  # the speeds went back to 1.0 in between
        assert planned.plan.num_devices == 4 and (planned.plan.topology is None or planned.plan.topology.uniform_speed)
    finally:
        client.close()


def test_the_metric_is_set_per_worker_without_ray():
    calls = []

    class Metrics:
        def on_speeds(self, worker_ids, nodes, speeds):
            calls.append((tuple(worker_ids), tuple(nodes), tuple(speeds)))

    watch = SpeedWatch(print, metrics=Metrics(), seeds={2: 0.5})
    record = {"source": "train", "skipped": True, "plan": None, "ranks": None, "recoveries": []}
    assert watch.observe(record, TINY, [0, 2], ["n0", None], {0: 11}) == []
    assert calls == [((0, 2), ("n0", None), (1.0, 0.5))]
    RunMetrics("run").on_speeds([0, 2], ["n0", None], [1.0, 0.5])  # the Ray gauge, no cluster


def _record(speeds: dict[int, float], recoveries=()) -> dict:
    """A trained SP step of one micro-batch, rank r alone on a 100-token sequence, run at ``speeds[r]``."""
    from flexorch.solver.cost_model import group_time_ms

    nominal = group_time_ms([100], 1, "ulysses", TINY)
    n = len(speeds)
    return {
        "source": "train", "skipped": False, "pipeline": None, "recoveries": list(recoveries),
        "plan": {"num_devices": n, "micro_batches": [[
            {"degree": 1, "kind": "ulysses", "ranks": [r], "seq_ids": [r], "seq_lengths": [100]} for r in range(n)
        ]]},
        "ranks": [{"micro_batch_ms": [nominal / speeds[r]], "compile_s": 0.0} for r in range(n)],
    }  # fmt: skip


def test_the_watch_follows_the_world_and_answers_the_retire():
    events = []
    watch = SpeedWatch(events.append)
    world, nodes = [0, 1, 2, 3], ["n0", "n0", "n1", "n1"]
    slow = _record({0: 1.0, 1: 1.0, 2: 1.0, 3: 0.25})
    assert watch.observe(slow, TINY, world, nodes) == [], "a world's first step is left out"
    for _ in range(3):
        watch.observe(_record({0: 1.0, 1: 1.0, 2: 1.0, 3: 0.25}), TINY, world, nodes)
    assert [(e["worker"], e["node"], e["slow"]) for e in events] == [(3, "n1", True)]
    assert watch.estimate(3) == pytest.approx(0.25) and watch.slow_workers(0.3, 2) == [3]
    assert watch.slow_workers(0.3, 4) == [] and watch.slow_workers(0.2, 2) == [], "not for 4 steps; not below 0.2"
    assert watch.planning_topology(None, 4, world).speeds == (1.0, 1.0, 1.0, 0.25)
    # worker 3 retired: the next record's world lacks it, so it is forgotten and that step is left out
    rec = _record({0: 0.25, 1: 1.0, 2: 1.0}, recoveries=[{"what": "retire", "lost": [3]}])
    assert watch.observe(rec, TINY, [0, 1, 2], nodes[:3]) == [] and watch.estimate(3) == 1.0
    assert watch.slow_workers(0.3, 1) == [] and rec["ranks"][0]["speed"] == 1.0
    # the same world with a membership change made for its step (a retry): a new world again
    watch.observe(_record({0: 0.25, 1: 1.0, 2: 1.0}, recoveries=[{"what": "run step 7"}]), TINY, [0, 1, 2])
    assert watch.estimate(0) == 1.0 and len(events) == 1


def test_a_plan_asked_ahead_stands_for_small_speed_moves_and_not_for_a_worker_gone_slow():
    from flexorch.control.step_plans import _close

    one = Topology.single(4)
    assert _close(None, None) and _close(one, None) and _close(None, one.with_speeds((1.0, 1.0, 1.0, 0.85)))
    assert _close(one.with_speeds((1.0, 1.0, 1.2, 0.5)), one.with_speeds((1.0, 1.0, 1.0, 0.55)))
    assert not _close(None, one.with_speeds((1.0, 1.0, 1.0, 0.5)))  # gone slow: solved again
    assert not _close(one.with_speeds((1.0, 1.0, 1.0, 0.5)), None)  # back: solved again
    two = Topology((2, 2))
    assert _close(two, two.with_speeds((1.0, 0.9, 1.0, 1.0))) and not _close(two, Topology((3, 1)))
    assert not _close(two, None) and not _close(None, two)
