"""Elastic membership on a multi-node Ray cluster (``ray.cluster_utils.Cluster``: several raylets on this machine).

A node is removed mid-run (its workers die with it: the run shrinks in place), a node is added (the next steps use
more workers), and a run that falls below ``min_workers`` waits for capacity: it goes on when a node joins in
time and fails with a clear message, checkpoint intact, when none does.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from flexorch.config import CorpusConfig
from flexorch.control.driver import TrainingDriver
from flexorch.control.elastic import ElasticError
from tests.train_helpers import check_against_reference, cpu_profile, next_record, train_config, write_corpus

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    ray.init(address=c.address, logging_level="ERROR")
    from flexorch.data.corpus import load_corpus

    corpus_dir = write_corpus(tmp_path / "corpus")
    corpus = load_corpus(CorpusConfig(source=str(corpus_dir), max_context=256))
    yield c, corpus_dir, cpu_profile(tmp_path / "profile.json"), corpus, tmp_path
    ray.shutdown()
    c.shutdown()


def _cfg(env, name, **kw):
    _, corpus_dir, profile, _, root = env
    return train_config(corpus_dir, root / name, profile, plan={"tokens_per_worker": 128}, **kw)


def _nodes_of(driver) -> dict[int, str]:
    infos = driver.workers.call("info")
    return {wid: info["node_id"] for wid, info in zip(driver.workers.worker_ids, infos, strict=True)}


def _stage_ranks(rec: dict) -> list[list[int]]:
    return rec["pipeline"]["stage_ranks"] if rec["pipeline"] is not None else []


def _ranks_used(rec: dict) -> set[int]:
    if rec["pipeline"] is not None:
        return {r for rs in rec["pipeline"]["stage_ranks"] for r in rs}
    return {r for mb in rec["plan"]["micro_batches"] for g in mb for r in g["ranks"]}


@pytest.mark.parametrize("stages", [1, 2])
def test_node_removed_then_added_mid_run(cluster, stages):
    # with pipeline_stages = 2 the stages are re-mapped each time: 2 x 2 workers, 2 x 1 after the loss, 2 x 2 again;
    # each worker holds its stage's layers only, so when node B held a whole stage (its ranks are contiguous: with 2
    # stages it always does) the run rolls back to the checkpoint of step 1 (checkpoint every step) and re-trains
    # it, else the survivors re-run it in place
    c, corpus = cluster[0], cluster[3]
    node_b = c.add_node(num_cpus=2)
    c.wait_for_nodes()
    cfg = _cfg(
        cluster,
        f"remove-add-{stages}",
        steps=20,
        elastic={"max_workers": 4},
        pipeline={"stages": stages},
        checkpoint_every=stages - 1,
    )
    driver = TrainingDriver(cfg, corpus=corpus)
    try:
        driver.setup()
        on_b = sorted(w for w, n in _nodes_of(driver).items() if n == node_b.node_id)
        assert len(on_b) == 2, "the head holds two workers, node B the other two"
        records = [next_record(driver)]
        c.remove_node(node_b)
        records.append(next_record(driver))
        rec = records[1]["recoveries"][0]
        assert sorted(rec["lost"]) == on_b and records[1]["world_size"] == 2
        # ranks are contiguous per node, so with 2 stages node B's two workers are one whole stage
        stage_workers = [sorted(records[0]["worker_ids"][r] for r in rs) for rs in _stage_ranks(records[0])]
        assert bool(rec.get("rollback")) == (stages == 2 and on_b in stage_workers)  # node B held a whole stage
        assert records[1]["step"] == 1
        c.add_node(num_cpus=2)
        deadline = time.monotonic() + 90
        while records[-1]["world_size"] < 4 and time.monotonic() < deadline:
            records.append(next_record(driver))
        grown = records[-1]
        assert grown["world_size"] == 4, "the run grew onto the new node"
        assert any(r.get("what") == "grow" for r in grown["recoveries"])
        assert max(_ranks_used(grown)) == 3, "the plan uses the new workers"
        if stages == 2:
            assert records[0]["pipeline"]["stage_ranks"] == [[0, 1], [2, 3]]
            assert records[1]["pipeline"]["stage_ranks"] == [[0], [1]]
            assert grown["pipeline"]["stage_ranks"] == [[0, 1], [2, 3]]
        assert len(set(grown["worker_ids"]) - {0, 1, 2, 3}) == 2, "newcomers have fresh worker ids"
        records.append(next_record(driver))
        replicas = driver.replica_parameters()
    finally:
        driver.shutdown()
    check_against_reference(cfg, corpus, records, replicas, whole=stages == 1)


@pytest.mark.parametrize("node_joins", [True, False])
def test_below_min_workers_waits_for_capacity(cluster, node_joins):
    from flexorch.control.checkpoint import latest_checkpoint

    c, corpus = cluster[0], cluster[3]
    node_b = c.add_node(num_cpus=2)
    c.wait_for_nodes()
    # a joining node needs its raylet up and its worker processes to import torch before it is capacity
    wait_s = 60.0 if node_joins else 8.0
    cfg = _cfg(cluster, f"wait-{node_joins}", steps=3, elastic={"min_workers": 4, "wait_s": wait_s}, checkpoint_every=1)
    driver = TrainingDriver(cfg, corpus=corpus)
    try:
        driver.setup()
        records = [next_record(driver)]
        driver.checkpointer.wait()  # step 1's checkpoint written (async by default) before its writer's node goes
        c.remove_node(node_b)
        if node_joins:
            # the step waits for capacity in a thread; the node joins from this (main) thread, as Ray requires
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(next_record, driver)
                time.sleep(2.0)
                c.add_node(num_cpus=2)
                records.append(waiting.result(timeout=120))
            records.append(next_record(driver))
            rec = records[1]["recoveries"][0]
            assert rec["decisions"][0] == "WaitForCapacity" and records[1]["world_size"] == 4
            check_against_reference(cfg, corpus, records, driver.replica_parameters())
        else:
            t0 = time.monotonic()
            with pytest.raises(ElasticError, match=r"min_workers=4.*elastic.wait_s=8.*checkpoint_000001.*--resume"):
                driver.step()
            assert time.monotonic() - t0 < 60
            assert latest_checkpoint(cfg.run_dir).path.endswith("checkpoint_000001")
    finally:
        driver.shutdown()
