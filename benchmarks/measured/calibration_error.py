"""Where the cost model's step prediction goes wrong, for adaptive and static plans side by side (issue 18, item 6).

Trains the same batches with the adaptive planner and with static layouts on real CPU workers (the workload and
drivers of ``benchmarks/measured/train.py``), then takes each step's prediction apart against what every rank measured:

* ``barrier``: the planner's prediction (``predicted_ms``): micro-batches one after another, each as long as its
  slowest group (FlexSP, arXiv 2412.01523, §4.1.2: the step is the sum over micro-batches of the max over groups).
* ``flow``: the same group times on the schedule the workers really follow: there is no barrier between
  micro-batches, a group starts when all its ranks have finished their previous one (``dataflow_ms``).
* per group: the measured time (the slowest of its ranks, from each rank's ``micro_batch_ms``) against the cost
  model's ``group_time_ms``, binned by degree/kind, by how many documents the group holds, and by how many workers
  were computing at the same time (``busy``: the mean number of ranks inside a micro-batch while this group ran;
  more than the machine has cores means the group shared a core).

    python -m benchmarks.measured.calibration_error              # every layout with and without refit, ~6 min
    python -m benchmarks.measured.calibration_error --refit off  # the start-up calibration alone

Per step (issue 48), ``--runs demo,hf``: ``flexorch train`` on the demo's run file (``examples/train_laptop.toml``:
4 CPU workers, calibrated profile, refits every 4 steps, 20 steps), and the same with its model built by Transformers
(``[model] hf``: a Llama of the same shape), one after the other. For every step: the plan's shape, the prediction
the run made (``predicted_ms``, from the profile revision that planned it: refits on trial, kept or rolled back),
the run's step level it was multiplied by (``solver.step_level``: measured over predicted of the steps before it),
the same plan priced by the start-up calibration alone (revision 0, ``profile.json``, no level), the measured step
(``measured_ms``) and both errors; then the refit lines the run printed, and the median and worst error over steps
3-20 (the done-when of issue 48: median at most 5 %, worst within 15 %, on an otherwise idle machine); last, the
machine's own floor (``benchmarks.measured.machine_noise``): the same work in 4 processes at once, in chunks of a
worker's share of the median step, and how far those chunks lie from their median.
``--records DIR`` prints the same table for a run that has already run (its ``steps.jsonl``, ``profile.json``).

    python -m benchmarks.measured.calibration_error --runs demo,hf     # about 4 minutes on 2 cores
    python -m benchmarks.measured.calibration_error --records runs/train
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

from benchmarks.common import ROOT, run_main, start_local_ray  # noqa: E402
from benchmarks.measured.train import step_mode, write_workload  # noqa: E402
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


def per_step(run_dir: Path, first: int = 3) -> dict:
    """The per-step table of a finished run (``--runs``/``--records``), printed; its summary returned."""
    from flexorch.solver.profiles import load_profile
    from flexorch.solver.record_samples import step_of_record

    calibrated = load_profile(run_dir / "profile.json")
    recs = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines() if line.strip()]
    recs = [r for r in recs if r.get("source") == "train" and r.get("plan")]
    print(f"\n{run_dir}: per step, predicted vs measured (error = predicted / measured - 1)")
    print(
        f"{'step':>4s} {'rev':>3s} {'level':>5s} {'measured':>9s} {'predicted':>9s} {'err':>7s} {'calibrated':>10s} "
        f"{'err':>7s}  plan"
    )
    errs, errs0 = [], []
    measured, priced0, steps = [], [], []
    for r in recs:
        step = step_of_record(r, calibrated.mode_time_ratios())
        ms, pred = r["measured_ms"], r["predicted_ms"]
        pred0 = step.predict_ms(calibrated)
        measured.append(ms)
        priced0.append(pred0)
        steps.append(r["step"] + 1)
        e, e0 = pred / ms - 1, pred0 / ms - 1
        if r["step"] + 1 >= first:
            errs.append(abs(e))
            errs0.append(abs(e0))
        print(
            f"{r['step'] + 1:4d} {r.get('profile_revision', 0):3d} {r.get('level', 1.0):5.2f} {ms:9.1f} {pred:9.1f} "
            f"{100 * e:+6.1f}% "
            f"{pred0:10.1f} {100 * e0:+6.1f}%  {r['shape'][:60]}"
        )
    by_rev: dict[int, list[float]] = defaultdict(list)  # each profile revision: the errors of the steps it planned
    for r in recs:
        if r["step"] + 1 >= first:
            by_rev[r.get("profile_revision", 0)].append(abs(r["predicted_ms"] / r["measured_ms"] - 1))
    print(
        "per profile revision (0: calibrated; each refit taken up or rolled back is the next): "
        + ", ".join(f"rev {k}: {len(v)} steps, median {100 * np.median(v):.1f} %" for k, v in sorted(by_rev.items()))
    )
    out = {
        "by_revision": {str(k): float(np.median(v)) for k, v in sorted(by_rev.items())},
        "steps": len(errs),
        "median_err": float(np.median(errs)),
        "worst_err": float(np.max(errs)),
        "calibrated_median_err": float(np.median(errs0)),
        "calibrated_worst_err": float(np.max(errs0)),
        "median_step_ms": float(np.median([measured[i] for i, step in enumerate(steps) if step >= first])),
    }
    print(
        f"steps {first}-{recs[-1]['step'] + 1}: as predicted median {100 * out['median_err']:.1f} %, worst "
        f"{100 * out['worst_err']:.1f} %; calibration alone median {100 * out['calibrated_median_err']:.1f} %, "
        f"worst {100 * out['calibrated_worst_err']:.1f} %"
    )
    later = [i for i, step in enumerate(steps) if step >= first]
    floor = noise_floor([measured[i] for i in later], [priced0[i] for i in later])
    if floor is not None:
        out["noise_floor"] = floor
        print(
            f"noise floor: {floor['steps']} of these steps are of {floor['kinds']} kinds the calibration prices alike "
            f"(3 steps or more each); they lie a median {100 * floor['median']:.1f} % and at most "
            f"{100 * floor['worst']:.1f} % from the median time of their kind: what knowing each kind's typical time "
            "would still miss"
        )
    return out


def noise_floor(measured: list[float], priced: list[float], at_least: int = 3, tol: float = 0.005) -> dict | None:
    """How far steps the start-up calibration prices the same (``priced`` within ``tol``: the same slowest chain of
    groups in the cost model, e.g. eight micro-batches of two 2048-token groups, whatever the shorter documents
    beside them) lie from the median time of their kind: what a model that knew each kind's typical time would still
    miss on this machine. None when no price recurs ``at_least`` times."""
    kinds: list[tuple[float, list[float]]] = []
    for m, p in zip(measured, priced, strict=True):
        same = next((ms for q, ms in kinds if abs(p / q - 1) <= tol), None)
        if same is None:
            kinds.append((p, [m]))
        else:
            same.append(m)
    devs = [abs(m / np.median(ms) - 1) for _, ms in kinds if len(ms) >= at_least for m in ms]
    if not devs:
        return None
    count = sum(len(ms) >= at_least for _, ms in kinds)
    return {"steps": len(devs), "kinds": count, "median": float(np.median(devs)), "worst": float(np.max(devs))}


def run_per_step(names: list[str], out: Path) -> int:
    """``flexorch train`` on the demo's run file (``demo``) and on its Transformers twin (``hf``), one at a time."""
    import subprocess
    import tomllib

    from benchmarks.measured.hf_step_time import hf_twin
    from flexorch.config import model_config

    demo = ROOT / "examples" / "train_laptop.toml"
    summary = {}
    for name in names:
        run_dir = out / name
        cmd = [sys.executable, "-m", "flexorch", "train", "--config", str(demo), "--run-dir", str(run_dir)]
        if name == "hf":
            raw = tomllib.loads(demo.read_text())
            twin = hf_twin(model_config(raw["model"]["preset"]), out / "hf-model")
            body = demo.read_text().replace(f'preset = "{raw["model"]["preset"]}"', f'hf = "{twin.hf}"')
            body = body.replace("[data]\n", '[data]\ntokenizer = "byte"\n', 1)
            (out / "hf.toml").write_text(body)
            cmd[cmd.index(str(demo))] = str(out / "hf.toml")
        elif name != "demo":
            raise SystemExit(f"--runs: unknown run {name!r} (demo, hf)")
        out.mkdir(parents=True, exist_ok=True)
        print(f"running {name}: {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        log = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if log.returncode:
            print(log.stdout[-3000:], log.stderr[-3000:])
            return log.returncode
        print(f"{name}: {time.perf_counter() - t0:.0f} s; the run's cost model lines:")
        for line in log.stdout.splitlines():
            if "cost model" in line or line.startswith("profile:"):
                print("  " + line[:240])
        summary[name] = per_step(run_dir)
    summary["machine"] = _machine_floor(summary, out)
    (out / "per_step.json").write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {out / 'per_step.json'}; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end")
    return 0


def _machine_floor(summary: dict, out: Path) -> dict:
    """``benchmarks.measured.machine_noise`` with the demo's shape: its 4 workers' processes at once, each chunk one
    worker's share of the median step measured (the machine's cores split between them). Printed and returned."""
    from benchmarks.measured.machine_noise import describe, machine_noise

    step_ms = float(np.median([s["median_step_ms"] for s in summary.values()]))
    workers = 4  # examples/train_laptop.toml
    noise = machine_noise(workers, step_ms / 1e3 * min(workers, os.cpu_count() or 1) / workers, chunks=8)
    print(describe(noise) + ": no prediction of a step of that length can be nearer than that on this machine")
    return noise


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=None, help="per-step mode: comma-separated runs of the demo: demo, hf")
    ap.add_argument("--records", type=Path, default=None, help="per-step table of a finished run directory")
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
    if args.records is not None:
        per_step(args.records)
        return 0
    if args.runs:
        return run_per_step([r for r in args.runs.split(",") if r], args.out / "per_step")
    steps = 5 if args.quick else args.steps

    import ray

    layouts = ["adaptive", *[m for m in args.static.split(",") if m]]
    refits = {"both": ("off", "on"), "on": ("on",), "off": ("off",)}[args.refit]
    modes = [(m, r) for m in layouts for r in refits]
    start_local_ray(len(modes) * args.workers + 2)
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
    raise SystemExit(run_main(main, "measured/calibration_error"))
