"""Recovery from a lost worker: in place (flexorch) vs restart from the last checkpoint (Ray Train / torchrun style).

Both strategies train the same model on the same stream with 4 CPU worker actors and a checkpoint after every
step (the best case for restarting). Each trial trains a few steps, then SIGKILLs one worker process half-way
through a step and measures the wall time from that kill to the next completed step:

- ``in-place``: the driver notices the loss, re-plans the in-flight step for the 3 survivors and re-runs it
  (detection, survivors' state, new world and the re-run step all included).
- ``restart``: what a restart-based trainer does: notice the loss (the same detection), stop every worker,
  start a new driver and worker group, load the last checkpoint, re-run the step.

Growing is timed twice: after each in-place recovery the freed CPU slot gets a new worker that joins between
steps, and once a whole node joins a 3-worker run (``ray.cluster_utils.Cluster``: real raylets on this machine):
the time from the node's arrival to the first step on 4 workers (training goes on meanwhile; only the admission,
a state copy and a new world, blocks a step).

Every trial checks the ledger: the documents trained equal an uninterrupted stream's, none lost or repeated.
Writes ``results.json`` and ``recovery.svg`` (per-trial bars) into ``--out``.

    python -m benchmarks.recovery.recovery             # 3 trials per strategy, ~4 minutes on 2 cores
    python -m benchmarks.recovery.recovery --trials 1  # quicker
    python -m benchmarks.recovery.recovery --faults    # a killed / frozen worker or node and a lost driver x replicate/
                                              # fsdp/hsdp: detect, re-form, re-run (benchmarks/recovery/faults.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, results_path, run_main  # noqa: E402
from benchmarks.measured.train import write_workload  # noqa: E402
from flexorch.config import (  # noqa: E402
    CorpusConfig,
    ElasticSettings,
    ModelConfig,
    OptimConfig,
    PlanSettings,
    TrainConfig,
)
from flexorch.control.driver import TrainingDriver  # noqa: E402
from flexorch.data.corpus import load_corpus  # noqa: E402
from flexorch.data.stream import DocumentStream  # noqa: E402


def _kill_during_step(driver: TrainingDriver, rank: int, delay_s: float) -> tuple[float, dict | None, BaseException]:
    """Run a step in a thread and SIGKILL the worker at ``rank`` ``delay_s`` into it: (kill time, record, error)."""
    from benchmarks.recovery.faults import step_in_thread

    pid = driver.workers.call("info")[rank]["pid"]
    t, out = step_in_thread(driver)
    time.sleep(delay_s)
    killed_at = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    t.join()
    return killed_at, out.get("record"), out.get("error")


def trial_in_place(cfg: TrainConfig, corpus, warm: int, step_s: float) -> dict:
    driver = TrainingDriver(cfg, corpus=corpus)
    driver.setup()
    try:
        records = [driver.step().record for _ in range(warm)]
        killed_at, rec, err = _kill_during_step(driver, 1, step_s / 2)
        if err is not None:
            raise err
        done_at = time.perf_counter()
        records.append(rec)
        joined, deadline = None, time.monotonic() + 60
        while time.monotonic() < deadline:  # the freed slot gets a new worker; it joins at a boundary once up
            records.append(driver.step().record)
            grow = [r for r in records[-1]["recoveries"] if r.get("what") == "grow"]
            if grow:
                joined, joined_at = grow[0], time.perf_counter()
                break
        return {
            "recovery_s": done_at - killed_at,
            "redone_steps": 0 if rec["recoveries"][0]["step_completed"] else 1,
            "join_admit_ms": joined["recovery_ms"] if joined else None,
            "join_after_s": joined_at - done_at if joined else None,
            "records": records,
        }
    finally:
        driver.shutdown()


def trial_restart(cfg: TrainConfig, corpus, warm: int, step_s: float) -> dict:
    # max_attempts=1: the step fails rather than recovers, as a restart-based trainer has no in-place path
    driver = TrainingDriver(cfg.replace(elastic=ElasticSettings(max_attempts=1)), corpus=corpus)
    driver.setup()
    records = [driver.step().record for _ in range(warm)]
    killed_at, _, err = _kill_during_step(driver, 1, step_s / 2)
    assert err is not None, "the step should have failed"
    driver.shutdown()
    again = TrainingDriver(dataclasses.replace(cfg, resume=True), corpus=corpus)
    try:
        again.setup()
        records.append(again.step().record)
        done_at = time.perf_counter()
        return {"recovery_s": done_at - killed_at, "redone_steps": 1, "records": records}
    finally:
        again.shutdown()


def trial_join(cfg: TrainConfig, corpus, cluster) -> dict:
    """3 workers train; a node with one slot joins; time until a step runs on 4 workers (training goes on)."""
    driver = TrainingDriver(cfg, corpus=corpus)
    driver.setup()
    try:
        records = [driver.step().record for _ in range(2)]
        cluster.add_node(num_cpus=1)
        added_at = time.perf_counter()
        deadline = time.monotonic() + 120
        while records[-1]["world_size"] < 4 and time.monotonic() < deadline:
            records.append(driver.step().record)
        if records[-1]["world_size"] < 4:
            raise RuntimeError("the joining node was not absorbed within 120 s")
        grow = [r for r in records[-1]["recoveries"] if r.get("what") == "grow"][0]
        return {
            "first_step_s": time.perf_counter() - added_at,
            "steps_meanwhile": sum(1 for r in records[2:] if r["world_size"] == 3),
            "admit_ms": grow["recovery_ms"],
            "records": records,
        }
    finally:
        driver.shutdown()


def check_ledger(records: list[dict], num_docs: int, cfg: TrainConfig) -> None:
    stream = DocumentStream(num_docs, cfg.batch_size, cfg.seed)
    want = [list(stream.next_batch().doc_ids) for _ in records]
    got = [r["doc_ids"] for r in records]
    if got != want:
        raise AssertionError("documents lost or repeated: the trained batches differ from the stream's")


def write_svg(path: Path, rows: dict[str, list[float]]) -> None:
    """Horizontal bars: one per trial, grouped by strategy, seconds from the kill to the next completed step."""
    top = max(v for vals in rows.values() for v in vals) or 1.0
    w, bar, pad, left = 640, 18, 6, 110
    lines, y = [], 30
    colors = {"in-place": "#2b8a3e", "restart": "#c92a2a"}
    for name, vals in rows.items():
        for i, v in enumerate(vals):
            width = (w - left - 80) * v / top
            lines.append(f'<rect x="{left}" y="{y}" width="{width:.1f}" height="{bar}" fill="{colors[name]}"/>')
            lines.append(f'<text x="{left + width + 4:.1f}" y="{y + 13}" font-size="12">{v:.1f} s</text>')
            lines.append(f'<text x="4" y="{y + 13}" font-size="12">{name} #{i + 1}</text>')
            y += bar + pad
        y += 8
    title = "seconds from a worker's SIGKILL to the next completed step (4 CPU workers)"
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{y + 10}" font-family="sans-serif">'
        f'<text x="4" y="18" font-size="13">{title}</text>{"".join(lines)}</svg>'
    )
    path.write_text(svg)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3, help="trials per strategy (alternating)")
    ap.add_argument("--warm", type=int, default=3, help="steps before the kill")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_recovery")
    ap.add_argument(
        "--faults", action="store_true",
        help="instead: a killed / frozen worker, a killed / frozen node and a lost driver under replicate, fsdp and "
        "hsdp, default settings (benchmarks/recovery/faults.py)",
    )  # fmt: skip
    ap.add_argument(
        "--fault", action="append", choices=["killed process", "killed node", "frozen worker", "frozen node",
        "lost driver", "drained node", "frozen node, Ray hc"], help="with --faults: only these (repeatable)",
    )  # fmt: skip
    ap.add_argument(
        "--ray-health-check",
        default="500,3",
        metavar="PERIOD_MS,MISSES",
        help="with --faults: Ray's node health check for the 'frozen node, Ray hc' rows (default 500,3)",
    )
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # progress lines show as they happen, also when piped

    import ray

    shutil.rmtree(args.out, ignore_errors=True)  # trials must not resume an earlier run's checkpoints
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    from ray.cluster_utils import Cluster

    # a head with 3 CPU slots and a node with 1 (real raylets on this machine): the kill trials use all 4; the
    # join trial removes the small node, trains on 3, then adds a node back and times its absorption
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": False})
    extra = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    data_dir = args.out / "corpus"
    write_workload(data_dir, args.batch * (args.warm + 10), scale=8.0, max_context=1024, seed=1)
    base = TrainConfig(
        steps=10**6,
        workers=4,
        batch_size=args.batch,
        checkpoint_every=1,
        run_dir=str(args.out / "calibrate"),
        model=ModelConfig(),
        optim=OptimConfig(lr=1e-3, warmup_steps=1),
        data=CorpusConfig(source=str(data_dir), max_context=1024),
        plan=PlanSettings(tokens_per_worker=1024, time_limit_s=0.1),
    )
    corpus = load_corpus(base.data)
    print(f"workload: {corpus.num_docs} documents, {int(corpus.lengths.sum()):,} tokens; 4 workers; batch {args.batch}")
    cal = TrainingDriver(base, corpus=corpus)  # calibrate once; every trial plans with this profile
    cal.setup()
    step_s = statistics.median(cal.step().record["measured_ms"] / 1e3 for _ in range(3))
    cal.shutdown()
    profile = str(Path(base.run_dir) / "profile.json")
    print(f"a normal step takes {step_s:.2f} s; killing a worker {step_s / 2:.2f} s into step {args.warm + 1}")

    if args.faults:
        return _faults(args, base, corpus, profile, step_s, cluster, extra)

    results: dict[str, list[dict]] = {"in-place": [], "restart": []}
    t_trials, done, total = time.perf_counter(), 0, 2 * args.trials
    for i in range(args.trials):
        for name, trial in (("in-place", trial_in_place), ("restart", trial_restart))[:: 1 if i % 2 == 0 else -1]:
            run_dir = args.out / f"{name}-{i}"
            cfg = dataclasses.replace(base, run_dir=str(run_dir), plan=dataclasses.replace(base.plan, profile=profile))
            res = trial(cfg, corpus, args.warm, step_s)
            check_ledger(res["records"], corpus.num_docs, cfg)
            res["records"] = len(res["records"])
            results[name].append(res)
            how = "step re-run" if res["redone_steps"] else "the update had finished: step kept"
            done += 1
            eta = (time.perf_counter() - t_trials) / done * (total - done)
            print(
                f"  trial {i + 1} {name:<9s} kill -> next completed step {res['recovery_s']:6.2f} s ({how})  "
                f"[{done}/{total}, ETA {eta:.0f} s]"
            )

    cluster.remove_node(extra)
    cfg = dataclasses.replace(
        base,
        workers=3,
        elastic=ElasticSettings(max_workers=4),
        run_dir=str(args.out / "join"),
        plan=dataclasses.replace(base.plan, profile=profile),
    )
    join = trial_join(cfg, corpus, cluster)
    check_ledger(join.pop("records"), corpus.num_docs, cfg)

    med = {k: statistics.median(r["recovery_s"] for r in v) for k, v in results.items()}
    print()
    print(f"{'strategy':<10s} {'median s':>9s} {'min s':>7s} {'max s':>7s} {'re-runs':>7s} {'vs in-place':>12s}")
    for name, rows in results.items():
        vals = [r["recovery_s"] for r in rows]
        print(
            f"{name:<10s} {med[name]:9.2f} {min(vals):7.2f} {max(vals):7.2f} "
            f"{sum(r['redone_steps'] for r in rows):7d} {med[name] / med['in-place']:11.1f}x"
        )
    print(
        f"a node joining (1 slot, 3 workers training): first step on 4 workers {join['first_step_s']:.1f} s after "
        f"`add_node` returned ({join['steps_meanwhile']} steps trained on 3 meanwhile); admission (state copy + new "
        f"world) {join['admit_ms']:.0f} ms"
    )
    admits = [r["join_admit_ms"] for r in results["in-place"] if r["join_admit_ms"] is not None]
    if admits:
        after = statistics.median(r["join_after_s"] for r in results["in-place"] if r["join_after_s"] is not None)
        print(
            f"growing back: a new worker started on the freed slot joined {after:.1f} s after the recovered step "
            f"(median; training went on with 3 meanwhile), admission (state copy + new world) "
            f"{statistics.median(admits):.0f} ms; {len(admits)}/{len(results['in-place'])} trials grew back to 4"
        )
    print("ledger: every trial trained exactly the stream's documents (none lost, none repeated)")
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"step_s": step_s, "median_s": med, "join": join, **results}
    (args.out / "results.json").write_text(json.dumps(summary, indent=1))
    write_svg(args.out / "recovery.svg", {k: [r["recovery_s"] for r in v] for k, v in results.items()})
    print(f"wrote {args.out / 'results.json'} and {args.out / 'recovery.svg'}")
    ray.shutdown()
    cluster.shutdown()
    return 0


def _faults(args, base: TrainConfig, corpus, profile: str, step_s: float, cluster, extra) -> int:
    """The --faults table (``benchmarks/recovery/faults.py``); the lowered-health-check rows on a second cluster."""
    import ray

    from benchmarks.recovery.faults import print_table, run_faults, run_frozen_node_lowered

    rows = run_faults(args, base, corpus, profile, step_s, cluster, extra, check_ledger)
    print_table(rows, step_s, None, args.out)  # kept, whatever the second cluster does
    period, misses = (int(x) for x in args.ray_health_check.split(","))
    ray.shutdown()
    cluster.shutdown()
    if not args.fault or "frozen node, Ray hc" in args.fault:
        from ray.cluster_utils import Cluster

        health = {"health_check_period_ms": period, "health_check_failure_threshold": misses,
                  "health_check_timeout_ms": period, "health_check_initial_delay_ms": 0}  # fmt: skip
        head = {"num_cpus": 3, "include_dashboard": False, "_system_config": health}
        cluster = Cluster(initialize_head=True, head_node_args=head)
        extra = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        corpus = load_corpus(base.data)  # its blocks lived in the first cluster's object store
        try:
            rows += run_frozen_node_lowered(args, base, corpus, profile, step_s, cluster, extra, check_ledger)
        finally:
            ray.shutdown()
            cluster.shutdown()
    print_table(rows, step_s, (period, misses), args.out)
    return 0


if __name__ == "__main__":
    # the --faults table is its own results file
    faults = "--faults" in sys.argv[1:]
    raise SystemExit(run_main(main, "recovery/recovery", results_path("recovery/faults") if faults else ""))
