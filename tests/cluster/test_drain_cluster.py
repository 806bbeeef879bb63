"""A node drained with ``ray drain-node`` on a real multi-node Ray (``ray.cluster_utils.Cluster``: a raylet per node
on this machine) leaves the run at the next step boundary, nothing re-run or rolled back.

The head holds two workers (the driver runs in this process, on the head) and a worker node the other two. After two
steps the node is drained for preemption with a 60 s deadline by Ray's own CLI (autoscalers and KubeRay send the
same request). The test pins the private GCS call flexorch reads draining nodes with
(``flexorch.control.drains.draining_nodes``: the node, its deadline, its IP), that the driver sees the drain within a
second while idle between steps, that the next step's record has the ``drain`` recovery (the node's two workers
left, no re-run, no roll-back, no worker started on the draining node's freed slots), and that losses and parameters
equal the single-process reference, under ``fsdp``, ``hsdp`` 2x2 and 2 pipeline stages with fsdp within each: the
leaving workers' shards are handed to the stayers and re-sharded in memory. In the runs here Ray put workers 1 and 3,
or 0 and 2, on the node: ranks of one shard index, so under hsdp too the stayers lacked a shard without the handoff,
and a lost node would have sent each run back to its checkpoint (with the handoff stubbed out the fsdp case fails
so). The planned leave of replicas (nothing to hand off) and of stage-local pipeline parameters is the same path,
stepped without Ray in ``tests/unit/test_drains.py``. About 20 s a case here.
"""

from __future__ import annotations

import time

import pytest

from flexorch.config import ModelConfig
from flexorch.config.sharding import ShardingSettings
from flexorch.control.driver import TrainingDriver
from tests.ray_env import drain_node
from tests.train_helpers import check_against_reference, own_cluster, train_config

pytestmark = pytest.mark.slow

DEADLINE_S = 60


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from own_cluster(tmp_path_factory, "drain", head_cpus=2)


CASES = {
    "fsdp": dict(sharding=ShardingSettings(mode="fsdp")),
    "hsdp": dict(sharding=ShardingSettings(mode="hsdp", shard_size=2)),
    # 2 stages, fsdp within each: the node holds a rank of each stage, so each stage hands a shard over
    "fsdp-pipeline": dict(
        sharding=ShardingSettings(mode="fsdp"),
        pipeline={"stages": 2},
        model=ModelConfig(num_layers=4),
        plan={"tokens_per_worker": 256},
    ),  # fmt: skip
}


@pytest.mark.parametrize("mode", list(CASES))
def test_a_drained_node_leaves_at_the_next_boundary_and_the_run_matches_the_reference(cluster, mode):
    from flexorch.cli.train_console import format_membership
    from flexorch.control.drains import draining_nodes

    c, corpus_dir, profile, corpus, root = cluster
    for gone in [n for n in c.list_all_nodes() if n is not c.head_node]:  # the last case's, drained: it ended itself
        c.remove_node(gone, allow_graceful=False)
    node = c.add_node(num_cpus=2)
    c.wait_for_nodes()
    kw = {"plan": {"tokens_per_worker": 128}, **CASES[mode]}
    cfg = train_config(corpus_dir, root / mode, profile, steps=5, elastic={"min_workers": 2}, **kw)
    driver = TrainingDriver(cfg, corpus=corpus)
    records, walls = [], []
    try:
        driver.setup()
        nodes = dict(zip(driver.workers.worker_ids, (i["node_id"] for i in driver.workers.call("info")), strict=True))
        on_node = sorted(w for w, n in nodes.items() if n == node.node_id)
        assert len(on_node) == 2, nodes
        for _ in range(2):
            t0 = time.perf_counter()
            records.append(driver.step().record)
            walls.append(time.perf_counter() - t0)
        since = len(driver.events.poll(0)[0])
        drain_node(c.address, node.node_id, DEADLINE_S)
        asked = time.time()
        (drain,) = [d for d in draining_nodes() if d.node_id == node.node_id]
        assert DEADLINE_S - 5 < drain.left_s() <= DEADLINE_S and drain.ip
        seen = []
        while not seen and time.time() - asked < 5:
            time.sleep(0.05)
            seen = [e for e in driver.events.poll(since)[0] if e["event"] == "drain_seen"]
        assert seen and seen[0]["workers"] == on_node, "the drain watch saw the node holding workers drain"
        assert seen[0]["reason"] == "preemption", "a busy node accepts a preemption drain only"
        assert seen[0]["seen_at"] - asked < 1.5, "seen within a second (it polls every 0.5 s)"
        while len(records) < cfg.steps:
            t0 = time.perf_counter()
            t = driver.step()
            walls.append(time.perf_counter() - t0)
            records.append(t.record)
        assert not driver.workers.joining, "nothing was started on the draining node's freed slots"
        replicas = driver.replica_parameters()
    finally:
        driver.shutdown()
    rec = records[2]["recoveries"][0]
    assert rec["what"] == "drain" and rec["left"] == on_node and rec["fallback"] is None, rec
    assert rec["after_step"] == 1 and rec["deadline"] == pytest.approx(asked + DEADLINE_S, abs=5)
    assert rec["handoff_bytes"] > 0, "the leaving workers' shards were handed over"
    phases = rec["reform_phases_ms"]  # the slowest member's: leaving the last world, meeting, building the state
    assert set(phases) == {"leave", "rendezvous", "build", "exchange"} and sum(phases.values()) <= rec["reform_ms"] + 1
    assert [r["world_size"] for r in records] == [4, 4, 2, 2, 2]
    assert [len(r["recoveries"]) for r in records] == [0, 0, 1, 0, 0], "no loss, no re-run, no roll-back"
    assert [r["step"] for r in records] == list(range(5))
    line = format_membership({"event": "membership", **rec})
    print(f"\n{mode}: {line}")
    after = records[2]
    print(f"{mode}: step walls {[round(w, 2) for w in walls]} s; drain {rec['recovery_ms']:.0f} ms "
          f"(handoff {rec['handoff_ms']:.0f} ms, re-form {rec['reform_ms']:.0f} ms: "
          f"{ {k: round(v) for k, v in rec['reform_phases_ms'].items()} }); the step after: boundary "
          f"{after['boundary_ms']:.0f} ms, plan wait {after['plan_wait_ms']:.0f} ms, measured "
          f"{after['measured_ms']:.0f} ms")  # fmt: skip
    print(f"{mode}: measured ms by step {[round(r['measured_ms']) for r in records]}")
    check_against_reference(cfg, corpus, records, replicas, whole=cfg.pipeline.stages == 1)  # a stage: its layers
