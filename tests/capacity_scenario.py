"""The autoscaling scenario of ``tests/cluster/test_capacity.py``, run in a process of its own:

    python -m tests.capacity_scenario WORKDIR SUMMARY_JSON

A cluster with Ray's autoscaler (``tests.autoscaling_cluster``) scaled to zero: a head with no CPU and no worker
node. A 2-worker run starts on it: the driver asks the autoscaler for its workers' slots (one node may already be
coming for the corpus's own Ray task: without the request the run would start with the 1 worker that fits), the
nodes come, the workers start on them, the request is withdrawn at the first step boundary, and 3 steps train.

Then one of the two nodes gets a preemption notice (``ray drain-node``, 60 s deadline): its worker leaves at the next
step boundary, the run asks the autoscaler again for the lost worker's slot, the cloud ends the instance (here right
after the leave, not at its deadline: ``tests.preempting_provider``), the autoscaler launches a new node, a worker
starts there and joins, and the request is withdrawn: the run grew back with nobody acting. Checks the ledger,
losses and parameters of every step against the single-process reference and writes what the test asserts on.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

DEADLINE_S = 60


def _alive(ray, node_id: str) -> dict | None:
    return next((n for n in ray.nodes() if n["NodeID"] == node_id and n["Alive"]), None)


def drain_and_grow_back(ray, address: str, preempt: Path, driver, records: list) -> dict:
    """Drain the node of the run's last worker; once its worker left, the cloud ends the instance (before its
    deadline: the test need not wait 60 s); step until a worker on a new node joined (at most every 0.3 s meanwhile,
    as the wait is the autoscaler's); what the test asserts on."""
    from tests.ray_env import drain_node
    from tests.train_helpers import next_record

    nodes = dict(zip(driver.workers.worker_ids, (i["node_id"] for i in driver.workers.call("info")), strict=True))
    victim = nodes[max(nodes)]
    known = {n["NodeID"] for n in ray.nodes()}
    drain_node(address, victim, DEADLINE_S)
    t_drain = time.monotonic()
    drain = grow = None
    left_at, ended = None, False
    while grow is None and time.monotonic() - t_drain < 120:
        t0 = time.monotonic()
        records.append(next_record(driver))
        for r in records[-1]["recoveries"]:
            if r["what"] == "drain":
                drain, left_at = r, time.monotonic()
            elif r["what"] == "grow" and drain is not None:
                grow = r
        if left_at is not None and not ended:
            (preempt / victim).touch()  # the provider ends it at the autoscaler's next update
            ended = True
        time.sleep(max(0.0, 0.3 - (time.monotonic() - t0)))
    now = dict(zip(driver.workers.worker_ids, (i["node_id"] for i in driver.workers.call("info")), strict=True))
    return {
        "drain": {k: (drain or {}).get(k) for k in ("what", "reason", "left", "fallback", "rerun", "after_step")},
        "grew_back": grow is not None,
        "grown_s": (time.monotonic() - t_drain) if grow is not None else None,
        "joined": (grow or {}).get("joined"),
        "joined_on_new_node": bool(grow) and all(now[w] not in known for w in grow["joined"]),
        "victim_gone": _alive(ray, victim) is None,
    }


def main(root: Path, out: Path) -> None:
    os.environ["RAY_AUTH_MODE"] = "disabled"  # as the cluster runs (the suite's shared Ray exports 'token')
    import ray
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    from flexorch.config import CorpusConfig
    from flexorch.control.driver import TrainingDriver
    from flexorch.data.corpus import load_corpus
    from tests.autoscaling_cluster import autoscaling_cluster
    from tests.train_helpers import check_against_reference, cpu_profile, next_record, train_config, write_corpus

    corpus_dir = write_corpus(root / "corpus")
    elastic = {"min_workers": 1, "max_workers": 2, "request_capacity": True, "wait_s": 90.0}
    cfg = train_config(
        corpus_dir, root / "run", cpu_profile(root / "profile.json"), workers=2, steps=1000, elastic=elastic,
        plan={"tokens_per_worker": 256},
    )  # fmt: skip
    with autoscaling_cluster(node_cpus=1, max_nodes=3) as (address, preempt):
        ray.init(address=address, logging_level="ERROR", _node_ip_address="127.0.0.1")  # the head's raylet
        nodes_before = {n["NodeID"] for n in ray.nodes() if n["Alive"]}  # the head alone
        corpus = load_corpus(CorpusConfig(source=str(corpus_dir), max_context=256))
        driver = TrainingDriver(cfg, corpus=corpus)
        try:
            t0 = time.monotonic()
            driver.setup()
            setup_s = time.monotonic() - t0
            records = [next_record(driver) for _ in range(3)]
            on = {i["node_id"] for i in driver.workers.call("info")}
            first = [e for e in driver.poll(0)[0] if e["event"] == "capacity"]
            standing = json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL) or b"null")
            drained = drain_and_grow_back(ray, address, preempt, driver, records)
            records.append(next_record(driver))  # a step on the grown world
            events = [e for e in driver.poll(0)[0] if e["event"] == "capacity"]
            standing_end = json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL) or b"null")
            replicas = driver.replica_parameters()
        finally:
            driver.shutdown()
            ray.shutdown()
    (root / "records.json").write_text(json.dumps(records, indent=1, default=str))  # for a failing check below
    check_against_reference(cfg, corpus, records, replicas)
    summary = {
        "world_sizes": [r["world_size"] for r in records],
        "workers_on_new_nodes": len(on - nodes_before),
        "first_requests": [e["requested"] for e in first],
        "requests": [e["requested"] for e in events],
        "messages": [e["message"] for e in events],
        "standing_request_after_first_step": standing,
        "standing_request_at_the_end": standing_end,
        **drained,
        "setup_s": setup_s,
        "reference_checked": True,
    }
    out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
