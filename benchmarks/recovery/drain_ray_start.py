"""``ray drain-node`` on a cluster of ``ray start`` nodes: what the step after a planned leave costs, per sharding mode.

The cluster is ``benchmarks.recovery.driver_restart_job``'s: ``ray start --head --block`` (here 2 CPUs) and ``ray
start --address=... --block`` (2 CPUs) on loopback (here without token authentication). This process is the driver
(connected to the head, as in ``flexorch train --address``): 4 workers, of which Ray puts some on the second node.
After ``--warm`` steps that node is drained for preemption with a 60 s deadline by Ray's own CLI (``ray drain-node
--reason DRAIN_NODE_REASON_PREEMPTION``, what KubeRay and autoscalers send); its workers leave at the next step
boundary. The first (replicated) run calibrates the cost model; the others plan with its profile.
For each of replicate, fsdp, hsdp and 2 pipeline stages (fsdp within each) it prints the steps before the drain,
the step after it (its boundary, plan wait and run), the next steps of the smaller world, and the ratio of the step
after to the median step before, checks the ledger (every document once, none re-run) and compares every step's
loss and every rank's parameters with one process training the same batches (``flexorch.testing.reference``). A
fresh node replaces the drained one before the next mode.

    python -m benchmarks.recovery.drain_ray_start               # batch 256: steps of about 1 s here; ~6 minutes
    python -m benchmarks.recovery.drain_ray_start --batch 64    # steps of 0.2-0.4 s
    python -m benchmarks.recovery.drain_ray_start --mode fsdp   # one mode (repeatable; the first calibrates)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, run_main
from benchmarks.recovery.driver_restart_job import RAY, Cluster
from benchmarks.recovery.recovery import check_ledger

_HEAD = "node:__internal_head__"  # the resource only the head node has

MODES = {
    "replicate": {},
    "fsdp": {"sharding": {"mode": "fsdp"}},
    "hsdp": {"sharding": {"mode": "hsdp", "shard_size": 2}},
    "fsdp, 2 stages": {"sharding": {"mode": "fsdp"}, "pipeline": {"stages": 2}, "layers": 4},
}


def _config(base, run_dir: Path, mode: dict):
    from flexorch.config import ModelConfig, PipelineSettings, ShardingSettings

    cfg = dataclasses.replace(base, run_dir=str(run_dir))
    if "sharding" in mode:
        cfg = dataclasses.replace(cfg, sharding=ShardingSettings(**mode["sharding"]))
    if "pipeline" in mode:
        model = ModelConfig(num_layers=mode["layers"])
        cfg = dataclasses.replace(cfg, pipeline=PipelineSettings(**mode["pipeline"]), model=model)
    return cfg


def _drain(cluster: Cluster, node_id: str) -> float:
    cmd = [
        RAY,
        "drain-node",
        "--address",
        cluster.gcs,
        "--node-id",
        node_id,
        "--reason",
        "DRAIN_NODE_REASON_PREEMPTION",
        "--reason-message",
        "benchmark",
        "--deadline-remaining-seconds",
        "60",
    ]
    subprocess.run(cmd, env=cluster.env, check=True, capture_output=True, timeout=60)  # fmt: skip
    return time.time()


def trial(cfg, corpus, cluster: Cluster, node_id: str, warm: int) -> dict:
    """Train ``warm`` steps, drain the node, train the step after and two more; walls and the drain record."""
    from flexorch.control.driver import TrainingDriver

    driver = TrainingDriver(cfg, corpus=corpus)
    driver.setup()
    try:
        nodes = [i["node_id"] for i in driver.workers.call("info")]
        walls, records = [], []
        for _ in range(warm):
            t0 = time.perf_counter()
            records.append(driver.step().record)
            walls.append(time.perf_counter() - t0)
        _drain(cluster, node_id)
        time.sleep(1.0)  # the drain watch polls every 0.5 s; the leave comes at the next boundary either way
        for _ in range(3):
            t0 = time.perf_counter()
            records.append(driver.step().record)
            walls.append(time.perf_counter() - t0)
        replicas = driver.replica_parameters()
    finally:
        driver.shutdown()
    after = records[warm]
    drain = next((r for r in after["recoveries"] if r.get("what") == "drain"), None)
    if drain is None:
        raise RuntimeError(f"no worker left at the boundary after the drain ({nodes.count(node_id)} on the node)")
    return {
        "on_node": sum(n == node_id for n in nodes),
        "before": walls[:warm],
        "after": walls[warm],
        "next": walls[warm + 1 :],
        "parts": [after[k] / 1e3 for k in ("boundary_ms", "plan_wait_ms", "measured_ms")],
        "tokens": [r["tokens"] for r in records],  # batches differ (long-tailed lengths): walls per token compare them
        "drain": drain,
        "records": records,
        "off_reference": _off_reference(cfg, corpus, records, replicas),
    }


def _off_reference(cfg, corpus, records: list[dict], replicas: list) -> tuple[float, float]:
    """(largest relative loss difference, largest parameter difference) of the run against one process training the
    same batches (``flexorch.testing.reference``); every rank's parameters, stage-local parts included."""
    import numpy as np

    from flexorch.testing.reference import reference_train

    losses, state = reference_train(cfg.model, cfg.optim, [corpus.get_stored(r["doc_ids"]) for r in records], cfg.seed)
    loss_off = max(abs(r["loss"] - ref) / abs(ref) for r, ref in zip(records, losses, strict=True))
    param_off = max(
        float(np.max(np.abs(np.asarray(value) - state[name].numpy()))) for params in replicas for name, value in params
    )
    return loss_off, param_off


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--warm", type=int, default=3, help="steps before the drain")
    ap.add_argument("--workdir", type=Path, default=ROOT / "runs" / "bench_drain_ray_start")
    ap.add_argument("--mode", action="append", choices=list(MODES), help="only these modes (repeatable)")
    args = ap.parse_args(argv)

    import ray

    from benchmarks.measured.train import write_workload
    from flexorch.config import CorpusConfig, ModelConfig, OptimConfig, PlanSettings, TrainConfig
    from flexorch.data.corpus import load_corpus

    args.workdir.mkdir(parents=True, exist_ok=True)
    # a head of 2 CPUs: the 4 workers fill both nodes, so no free slot starts a joiner during the step after the leave
    # (on this 2-core machine a starting worker process takes CPU from the step; on a real node its slot's core is idle)
    cluster = Cluster(args.workdir, args.workdir / "cache", head_cpus=2)
    # without token authentication: this process imported Ray (and read RAY_AUTH_MODE) before the cluster existed
    cluster.env["RAY_AUTH_MODE"] = "disabled"
    cluster.start()
    node_proc, node_temp = cluster.procs[-1], cluster.temps[1]
    rows = []
    try:
        ray.init(address=cluster.gcs, logging_level="ERROR", log_to_driver=False)
        data = args.workdir / "corpus"
        write_workload(data, args.batch * (args.warm + 8), scale=8.0, max_context=1024, seed=1)
        base = TrainConfig(
            steps=10**6, workers=4, batch_size=args.batch, model=ModelConfig(),
            optim=OptimConfig(lr=1e-3, warmup_steps=1), data=CorpusConfig(source=str(data), max_context=1024),
            plan=PlanSettings(tokens_per_worker=1024),
        )  # fmt: skip
        corpus = load_corpus(base.data)
        print(
            f"workload: {corpus.num_docs} documents; 4 workers on a head of 2 CPUs and a node of 2; batch {args.batch}"
        )
        for name, mode in MODES.items():
            if args.mode and name not in args.mode:
                continue
            node_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and _HEAD not in n["Resources"])
            cfg = _config(base, args.workdir / name.replace(", ", "-").replace(" ", "-"), mode)
            res = trial(cfg, corpus, cluster, node_id, args.warm)
            check_ledger(res.pop("records"), corpus.num_docs, cfg)
            rows.append((name, res))
            if base.plan.profile == "auto":  # calibrated once, on the replicated run: the others plan with it
                plan = dataclasses.replace(base.plan, profile=str(Path(cfg.run_dir) / "profile.json"))
                base = dataclasses.replace(base, plan=plan)
            d = res["drain"]
            print(
                f"  {name:<15s} {res['on_node']} worker(s) on the drained node; steps before "
                f"{[round(w, 2) for w in res['before']]} s; the step after {res['after']:.2f} s (boundary "
                f"{res['parts'][0]:.2f}, plan wait {res['parts'][1]:.2f}, run {res['parts'][2]:.2f}); next "
                f"{[round(w, 2) for w in res['next']]} s; leave {d['recovery_ms'] / 1e3:.2f} s (re-form "
                f"{d['reform_ms'] / 1e3:.2f} s), fallback {d['fallback']}, re-run {d['rerun']}; against the "
                f"single-process reference: losses within {res['off_reference'][0]:.1e} (relative), parameters "
                f"within {res['off_reference'][1]:.1e}",
                flush=True,
            )
            cluster.stop_node(node_proc, node_temp)  # the drained node goes; a fresh one for the next mode
            node_temp = Path(tempfile.mkdtemp(prefix="fxj-", dir="/tmp"))
            cluster.temps.append(node_temp)
            node_proc = cluster.start_node(node_temp, f"node-{len(rows)}")
    finally:
        ray.shutdown()
        cluster.stop()
    print()
    print(
        f"{'mode':<15s} {'before s (median)':>18s} {'after s':>8s} {'next s (median)':>16s} {'after/before':>13s} "
        f"{'after/next':>11s} {'per token':>10s}"
    )
    for name, r in rows:
        before, nxt = statistics.median(r["before"]), statistics.median(r["next"])
        w, warm = r["tokens"], len(r["before"])
        nxt_per_token = statistics.median(s / t for s, t in zip(r["next"], w[warm + 1 :], strict=True))
        per_token = (r["after"] / w[warm]) / nxt_per_token
        print(
            f"{name:<15s} {before:18.2f} {r['after']:8.2f} {nxt:16.2f} {r['after'] / before:12.2f}x "
            f"{r['after'] / nxt:10.2f}x {per_token:9.2f}x"
        )
    print(
        "after/next: the step after the drain against the median of the next steps (the same smaller world); per "
        "token: the same with each step's wall divided by its tokens (the batches' tokens differ by up to 1.6x)"
    )
    print("ledger: every mode trained exactly the stream's documents (none lost, none re-run)")
    worst = max(r["off_reference"][0] for _, r in rows), max(r["off_reference"][1] for _, r in rows)
    print(f"against one process on the same batches: losses within {worst[0]:.1e}, parameters within {worst[1]:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "recovery/drain_ray_start"))
