"""Where the cost model's step prediction goes wrong, for adaptive and static plans side by side (issue 18, item 6).

Trains the same batches with the adaptive planner and with static layouts on real CPU workers (the workload and
drivers of ``benchmarks/train_cpu.py``), then takes each step's prediction apart against what every rank measured:

* ``barrier``: the planner's prediction (``predicted_ms``): micro-batches one after another, each as long as its
  slowest group (FlexSP, arXiv 2412.01523, §4.1.2: the step is the sum over micro-batches of the max over groups).
* ``flow``: the same group times on the schedule the workers really follow: there is no barrier between
  micro-batches, a group starts when all its ranks have finished their previous one (``dataflow_ms``).
* per group: the measured time (the slowest of its ranks, from each rank's ``micro_batch_ms``) against the cost
  model's ``group_time_ms``, binned by degree/kind, by how many documents the group holds, and by how many workers
  were computing at the same time (``busy``: the mean number of ranks inside a micro-batch while this group ran;
  more than the machine has cores means the group shared a core).

    python benchmarks/calibration_error.py              # every layout with and without refit, side by side, ~6 min
    python benchmarks/calibration_error.py --refit off  # the start-up calibration alone
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from train_cpu import step_mode, write_workload  # noqa: E402

from flexorch.config import CorpusConfig, ModelConfig, OptimConfig, PlanSettings, TrainConfig  # noqa: E402
from flexorch.control.driver import TrainingDriver  # noqa: E402
from flexorch.data.corpus import load_corpus  # noqa: E402


def _predicted(rec: dict) -> dict:
    """(micro-batch, group) -> the cost model's time of that group, as the record's timeline has it (the profile
    in force when the step ran: a refit changes it during the run)."""
    return {(t["micro_batch"], t["group"]): t["time_ms"] for t in rec["timeline"]}


def dataflow_ms(rec: dict) -> float:
    """The predicted step without barriers: each group starts when its ranks are all free (plan order per rank)."""
    free, pred = np.zeros(rec["world_size"]), _predicted(rec)
    for mi, mb in enumerate(rec["plan"]["micro_batches"]):
        for gi, g in enumerate(mb):
            start = max(free[r] for r in g["ranks"])
            free[g["ranks"]] = start + pred[(mi, gi)]
    return float(free.max())


def group_rows(rec: dict) -> list[dict]:
    """One row per group of one step: predicted and measured ms, documents, and the concurrency it ran under."""
    ranks = rec["ranks"]
    intervals = [  # every rank's micro-batch intervals, from its own step start
        (s, s + t)
        for e in ranks
        if e
        for s, t in zip(e["micro_batch_start_ms"], e["micro_batch_ms"], strict=True)
        if s is not None
    ]
    rows, pred = [], _predicted(rec)
    for mi, mb in enumerate(rec["plan"]["micro_batches"]):
        for gi, g in enumerate(mb):
            starts = [ranks[r]["micro_batch_start_ms"][mi] for r in g["ranks"]]
            ends = [s + ranks[r]["micro_batch_ms"][mi] for s, r in zip(starts, g["ranks"], strict=True)]
            a, b = min(starts), max(ends)
            grid = np.linspace(a, b, 32)
            busy = float(np.mean([sum(s <= x < e for s, e in intervals) for x in grid]))
            rows.append(
                {
                    "degree": g["degree"],
                    "kind": g["kind"],
                    "docs": len(g["seq_lengths"]),
                    "tokens": sum(g["seq_lengths"]),
                    "predicted": pred[(mi, gi)],
                    "measured": max(ranks[r]["micro_batch_ms"][mi] for r in g["ranks"]),
                    "busy": busy,
                }
            )
    return rows


def _err(p, m) -> float:
    return float(np.median(np.abs(np.asarray(p) - np.asarray(m)) / np.asarray(m)))


def _bias(p, m) -> float:
    return float(np.median((np.asarray(p) - np.asarray(m)) / np.asarray(m)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="5 steps per layout")
    ap.add_argument("--static", default="static-ulysses-2,static-ulysses-4,static-ring-4")
    ap.add_argument(
        "--refit",
        default="both",
        help="[plan] refit of every layout: off (the start-up calibration), on (refitted from the run's groups), or "
        "both (each layout twice, side by side, sharing one calibration: rows 'X' and 'X+refit')",
    )
    ap.add_argument("--refit-every", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_calibration_error")
    args = ap.parse_args(argv)
    steps = 5 if args.quick else args.steps

    import ray

    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    layouts = ["adaptive", *[m for m in args.static.split(",") if m]]
    refits = {"both": ("off", "on"), "on": ("on",), "off": ("off",)}[args.refit]
    modes = [(m, r) for m in layouts for r in refits]
    ray.init(address="local", num_cpus=len(modes) * args.workers + 2, include_dashboard=False, logging_level="ERROR")
    data_dir = args.out / "corpus"
    write_workload(data_dir, args.batch * (steps + 2), 4.0, 2048, seed=1)
    base = TrainConfig(
        steps=steps,
        workers=args.workers,
        batch_size=args.batch,
        run_dir=str(args.out),
        model=ModelConfig(num_layers=2),
        optim=OptimConfig(lr=1e-3, warmup_steps=1),
        data=CorpusConfig(source=str(data_dir), max_context=2048),
        plan=PlanSettings(tokens_per_worker=1024, time_limit_s=0.1, refit_every=args.refit_every),
    )
    corpus = load_corpus(base.data)

    def start(layout: str, refit: str, base: TrainConfig) -> TrainingDriver:
        name = layout + ("+refit" if refit == "on" else "")
        plan = dataclasses.replace(base.plan, mode=layout, refit=refit)
        driver = TrainingDriver(dataclasses.replace(base, run_dir=str(args.out / name), plan=plan), corpus=corpus)
        driver.setup()
        return driver

    # the first layout calibrates; every other one plans from that same profile (refitted or not)
    drivers = {modes[0][0] + ("+refit" if modes[0][1] == "on" else ""): start(*modes[0], base)}
    profile = Path(next(iter(drivers.values())).run_dir) / "profile.json"
    base = dataclasses.replace(base, plan=dataclasses.replace(base.plan, profile=str(profile)))
    for layout, refit in modes[1:]:
        drivers[layout + ("+refit" if refit == "on" else "")] = start(layout, refit, base)
    results = [{"mode": m, "records": [], "profile": drv.profile} for m, drv in drivers.items()]
    t0 = time.perf_counter()
    for i in range(steps):  # layouts take turns, rotating, so machine noise hits them alike
        for res in results[i % len(results) :] + results[: i % len(results)]:
            if "infeasible" not in res:
                step_mode(drivers[res["mode"]], res)
        print(f"round {i + 1}/{steps} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    for drv in drivers.values():
        drv.shutdown()
    ray.shutdown()

    print(f"\n{'layout':<24s} {'steps':>5s} {'compute':>8s} {'barrier':>8s} {'err':>6s} {'flow':>8s} {'err':>6s}")
    summary, by = [], defaultdict(list)
    for res in results:
        # the first step warms up; the first refit_every + 1 steps of every row are left out, so that refitted rows
        # (whose first refit comes after them) and the others are compared on the same steps
        recs = res["records"][args.refit_every + 1 :]
        if not recs:
            continue
        comp = [r["compute_ms"] for r in recs]
        barrier = [r["predicted_ms"] for r in recs]
        flow = [dataflow_ms(r) for r in recs]
        row = {
            "mode": res["mode"],
            "compute_ms": float(np.median(comp)),
            "barrier_ms": float(np.median(barrier)),
            "barrier_err": _err(barrier, comp),
            "barrier_bias": _bias(barrier, comp),
            "flow_ms": float(np.median(flow)),
            "flow_err": _err(flow, comp),
            "flow_bias": _bias(flow, comp),
        }
        summary.append(row)
        print(
            f"{row['mode']:<24s} {len(recs):5d} {row['compute_ms']:8.1f} {row['barrier_ms']:8.1f} "
            f"{100 * row['barrier_err']:5.1f}% {row['flow_ms']:8.1f} {100 * row['flow_err']:5.1f}%"
        )
        for r in recs:
            for g in group_rows(r):
                g["layout"] = ("adaptive" if res["mode"].startswith("adaptive") else "static") + (
                    "+refit" if res["mode"].endswith("+refit") else ""
                )
                for key in (
                    f"{g['layout']} d={g['degree']} {g['kind']}",
                    f"{g['layout']} docs {'1' if g['docs'] == 1 else '2-4' if g['docs'] <= 4 else '5+'}",
                    f"{g['layout']} busy {'<=2' if g['busy'] <= 2.0 else '2-3' if g['busy'] <= 3.0 else '>3'}",
                ):
                    by[key].append(g)
    print("\nper group: predicted (cost model) vs measured (slowest rank), median signed error (+ = over-predicted)")
    print(f"{'bin':<34s} {'groups':>6s} {'pred ms':>8s} {'meas ms':>8s} {'bias':>7s} {'|err|':>6s} {'busy':>5s}")
    groups = {}
    for key in sorted(by):
        gs = by[key]
        p, m = [g["predicted"] for g in gs], [g["measured"] for g in gs]
        groups[key] = {
            "n": len(gs),
            "bias": _bias(p, m),
            "err": _err(p, m),
            "busy": float(np.mean([g["busy"] for g in gs])),
        }
        print(
            f"{key:<34s} {len(gs):6d} {np.median(p):8.1f} {np.median(m):8.1f} {100 * groups[key]['bias']:+6.1f}% "
            f"{100 * groups[key]['err']:5.1f}% {groups[key]['busy']:5.2f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"layouts": summary, "groups": groups}, indent=1))
    print(f"\nwrote {args.out / 'results.json'}; this machine has {os.cpu_count()} cores for {args.workers} workers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
