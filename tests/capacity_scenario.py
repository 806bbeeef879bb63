"""The autoscaling scenario of ``tests/cluster/test_capacity.py``, run in a process of its own:

    python -m tests.capacity_scenario WORKDIR SUMMARY_JSON

A cluster with Ray's autoscaler (``tests.autoscaling_cluster``) scaled to zero: a head with no CPU and no worker
node. A 2-worker run starts on it: the driver asks the autoscaler for its workers' slots (one node may already be
coming for the corpus's own Ray task: without the request the run would start with the 1 worker that fits), the
nodes come, the workers start on them, the request is withdrawn at the first step boundary, and 3 steps train.
Checks the ledger, losses and parameters against the single-process reference and writes what the test asserts
on.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


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
        corpus_dir, root / "run", cpu_profile(root / "profile.json"), workers=2, steps=3, elastic=elastic,
        plan={"tokens_per_worker": 256},
    )  # fmt: skip
    with autoscaling_cluster(node_cpus=1, max_nodes=3) as address:
        ray.init(address=address, logging_level="ERROR", _node_ip_address="127.0.0.1")  # the head's raylet
        nodes_before = {n["NodeID"] for n in ray.nodes() if n["Alive"]}  # the head alone
        corpus = load_corpus(CorpusConfig(source=str(corpus_dir), max_context=256))
        driver = TrainingDriver(cfg, corpus=corpus)
        try:
            t0 = time.monotonic()
            driver.setup()
            setup_s = time.monotonic() - t0
            records = [next_record(driver) for _ in range(cfg.steps)]
            on = {i["node_id"] for i in driver.workers.call("info")}
            events = [e for e in driver.poll(0)[0] if e["event"] == "capacity"]
            standing = json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL) or b"null")
            replicas = driver.replica_parameters()
        finally:
            driver.shutdown()
            ray.shutdown()
    check_against_reference(cfg, corpus, records, replicas)
    summary = {
        "world_sizes": [r["world_size"] for r in records],
        "workers_on_new_nodes": len(on - nodes_before),
        "requests": [e["requested"] for e in events],
        "messages": [e["message"] for e in events],
        "standing_request_after_first_step": standing,
        "setup_s": setup_s,
        "reference_checked": True,
    }
    out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
