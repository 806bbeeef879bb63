"""Adaptive per-step plans vs every static SP layout, measured side by side on real CPU workers.

Workload: documents whose lengths are drawn from the bundled Wikipedia distribution (FlexSP's release), scaled to
a CPU context (``--scale``), clipped to ``--max-context``, each filled with real text (the standard library's
sources). Every layout trains the same model on the same batches (same seed, same stream) with the same 4 worker
actors' configuration; only the plan differs. ``--tokens-per-worker`` is the per-worker activation budget: the
longest documents need SP, so static SP=1 cannot run them (it is reported as infeasible).

Prints, per layout: median step time (dispatch to last outcome), median compute time (what the cost model
predicts) and the median prediction error, the speedup of adaptive over it, peak activation memory per worker
(measured from the tensors autograd saves) next to the plan's prediction, the driver's overhead share and how
much of the solve was hidden behind the previous step. Writes ``plans.svg`` (the adaptive plans as devices x
time) and ``results.json`` into ``--out``.

With ``--pipeline 2,4,auto`` the same run also trains with ``[pipeline] stages`` = 2, 4 and 'auto' (rows ``pp-2``,
``pp-4``, ``pp-auto``: the elastic pipeline planned per step against adaptive SP on the same batches); stages
split the layers, so pass ``--layers 4`` (every layout then trains the same 4-layer model). Pipelined rows also
print ``state MB``, the most bytes of parameters, gradients and AdamW state one worker held, and ``move ms``, the
median time per step spent copying stage-local parameters between workers; ``--pipeline-params
stage,replicated`` runs each pipelined layout both ways (rows ``pp-2`` and ``pp-2-replicated``).

    python -m benchmarks.measured.train            # ~5 minutes on 2 cores
    python -m benchmarks.measured.train --quick    # fewer steps
    python -m benchmarks.measured.train --layers 4 --static none --pipeline 2,4,auto --quick
    python -m benchmarks.measured.train --layers 4 --static none --pipeline 2,auto \\
        --pipeline-params stage,replicated --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sysconfig
import time
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT, run_main, start_local_ray  # noqa: E402
from flexorch.config import (  # noqa: E402
    CorpusConfig,
    ModelConfig,
    OptimConfig,
    PipelineSettings,
    PlanSettings,
    TrainConfig,
)
from flexorch.control.driver import TrainingDriver  # noqa: E402
from flexorch.data.corpus import load_corpus  # noqa: E402
from flexorch.data.lengths import bundled_lengths_path, read_lengths  # noqa: E402
from flexorch.records.writer import measured_bubble_share  # noqa: E402
from flexorch.solver.errors import InfeasibleBatchError  # noqa: E402


def write_workload(out: Path, n_docs: int, scale: float, max_context: int, seed: int) -> list[int]:
    """n_docs text files with Wikipedia-distributed lengths (bytes; +1 token for BOS)."""
    lengths = read_lengths(bundled_lengths_path())
    rng = np.random.default_rng(seed)
    sizes = np.clip((rng.choice(lengths, n_docs) / scale).astype(int), 8, max_context - 1)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join(p.read_bytes() for p in sorted(stdlib.glob("*.py"))[:60])
    out.mkdir(parents=True, exist_ok=True)
    pos = 0
    for i, n in enumerate(sizes):
        if pos + n > len(text):
            pos = 0
        (out / f"doc_{i:05d}.txt").write_bytes(text[pos : pos + n])
        pos += n
    return [int(s) + 1 for s in sizes]


def workload_config(args, steps: int) -> tuple[TrainConfig, object]:
    """The workload written to ``args.out / "corpus"`` (``steps + 2`` batches of documents), the run's base config
    (adaptive plans, ``args``' workers, batch, layers, context, budget and planning time) and the loaded corpus."""
    data_dir = args.out / "corpus"
    write_workload(data_dir, args.batch * (steps + 2), args.scale, args.max_context, seed=1)
    base = TrainConfig(
        steps=steps,
        workers=args.workers,
        batch_size=args.batch,
        run_dir=str(args.out),
        model=ModelConfig(num_layers=args.layers),
        optim=OptimConfig(lr=1e-3, warmup_steps=1),
        data=CorpusConfig(source=str(data_dir), max_context=args.max_context),
        plan=PlanSettings(tokens_per_worker=args.tokens_per_worker, time_limit_s=args.time_limit),
    )
    corpus = load_corpus(base.data)
    print(
        f"workload: {corpus.num_docs} documents, {int(corpus.lengths.sum()):,} tokens, longest "
        f"{int(corpus.lengths.max())}; {args.workers} workers x {args.tokens_per_worker} tokens; batch {args.batch}; "
        f"{args.layers} layers",
        flush=True,
    )
    return base, corpus


def start_mode(mode: str, base: TrainConfig, corpus) -> TrainingDriver:
    if mode.startswith("pp-"):  # a pipelined run: adaptive planning of pipelines over that many stages
        stages, _, placement = mode.removeprefix("pp-").partition("-")  # 'pp-2' or 'pp-2-replicated'
        cfg = dataclasses.replace(
            base,
            run_dir=str(Path(base.run_dir) / mode),
            pipeline=PipelineSettings(stages=stages if stages == "auto" else int(stages), params=placement or "stage"),
        )  # the elastic floor is derived for each layout (base sets none)
    else:
        cfg = dataclasses.replace(
            base,
            run_dir=str(Path(base.run_dir) / mode),
            plan=dataclasses.replace(base.plan, mode=mode),
        )  # each layout's own elastic floor, derived (a static SP=4 needs 4)
    driver = TrainingDriver(cfg, corpus=corpus)
    driver.setup()
    return driver


def step_mode(driver: TrainingDriver, result: dict) -> None:
    """One step of one layout; a layout that cannot run a batch is marked infeasible and stopped."""
    try:
        rec = driver.step().record
    except InfeasibleBatchError as e:
        result["infeasible"] = str(e).split(": ", 2)[-1].split(". Set")[0]
        driver.shutdown()
        return
    result["records"].append(rec)
    print(
        f"  step {rec['step'] + 1}  {result['mode']:<18s} {rec['shape']:<30s} {rec['measured_ms']:8.1f} ms", flush=True
    )


def _predicted_peak_bytes(rec: dict, profile) -> float:
    if rec["pipeline"] is not None:  # the pipeline simulator's most bytes held at once on a stage's worker
        return float(max(rec["pipeline"]["peak_bytes"]))
    peak = np.zeros(rec["world_size"])
    for mb in rec["plan"]["micro_batches"]:
        for g in mb:
            held = sum(g["seq_lengths"]) / g["degree"] * profile.act_bytes_per_local_token(g["kind"], g["degree"])
            for r in g["ranks"]:
                peak[r] = max(peak[r], held)
    return float(peak.max())


def summarise(result: dict) -> dict:
    recs = result["records"]
    measured = np.array([r["measured_ms"] for r in recs])
    compute = np.array([r["compute_ms"] for r in recs])
    predicted = np.array([r["predicted_ms"] for r in recs])
    overhead = np.array([(r["dispatch_ms"] + r["overhead_ms"]) / r["measured_ms"] for r in recs])
    return {
        "mode": result["mode"],
        "step_ms": float(np.median(measured)),
        "compute_ms": float(np.median(compute)),
        "predicted_ms": float(np.median(predicted)),
        "pred_error": float(np.median(np.abs(predicted - compute) / compute)),
        "peak_act_mb": max(max(x["peak_activation_bytes"] for x in r["ranks"] if x) for r in recs) / 1e6,
        "pred_act_mb": max(_predicted_peak_bytes(r, result["profile"]) for r in recs) / 1e6,
        "overhead": float(np.median(overhead)),
        "solve_s": float(np.median([r["solve_s"] for r in recs])),
        "plan_wait_ms": float(np.median([r["plan_wait_ms"] for r in recs])),
        "tokens_per_s": float(np.median([r["tokens_per_s"] for r in recs])),
        "shapes": [r["shape"] for r in recs],
        # pipelined layouts: most bytes of parameters, gradients and AdamW state one worker held, and the time spent
        # moving stage-local parameters between workers per step (median)
        "state_mb": None
        if recs[0]["pipeline"] is None
        else max(max(x["param_bytes"] for x in r["ranks"] if x) for r in recs) / 1e6,
        "move_ms": float(np.median([(r["pipeline"].get("params") or {}).get("move_ms", 0.0) for r in recs]))
        if recs[0]["pipeline"] is not None
        else None,
        # pipelined layouts: the schedule's bubble share, simulated and measured (medians over the steps)
        "bubble": None
        if recs[0]["pipeline"] is None
        else (
            float(np.median([r["pipeline"]["bubble_share"] for r in recs])),
            float(np.median([measured_bubble_share(r) for r in recs])),
        ),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64, help="documents per global batch")
    ap.add_argument("--steps", type=int, default=8, help="steps per layout (the first is a warm-up)")
    ap.add_argument("--scale", type=float, default=4.0, help="divide Wikipedia lengths by this")
    ap.add_argument(
        "--max-context", type=int, default=2048, help="2 x tokens-per-worker: static SP=2 can run every batch"
    )
    ap.add_argument("--tokens-per-worker", type=int, default=1024)
    ap.add_argument("--time-limit", type=float, default=0.1, help="planner budget per step, seconds")
    ap.add_argument("--static", default="all", help="comma-separated static layouts to compare, 'all' or 'none'")
    ap.add_argument("--pipeline", default="", help="comma-separated [pipeline] stages to compare too, e.g. 2,4,auto")
    ap.add_argument(
        "--pipeline-params",
        default="stage",
        help="[pipeline] params of the pipelined rows, comma-separated: stage (own layers only), replicated",
    )
    ap.add_argument("--layers", type=int, default=2, help="model layers (pipeline stages split them)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_train")
    ap.add_argument("--quick", action="store_true", help="4 steps per layout")
    args = ap.parse_args(argv)
    steps = 4 if args.quick else args.steps

    import ray

    # every layout keeps 4 worker actors up, so the cluster has many CPU slots (start_local_ray: none pre-started);
    # one slot per worker of every layout kept up: adaptive, up to 6 static SP layouts, the pipelined rows
    n_pipelined = len([p for p in args.pipeline.split(",") if p]) * len(args.pipeline_params.split(","))
    slots = (7 + n_pipelined) * args.workers + 2
    start_local_ray(slots)
    base, corpus = workload_config(args, steps)
    # calibrate once (the adaptive run's setup), then every layout plans with the same profile; all layouts stay
    # up and take their steps in turn (rotating the order), so machine noise hits them alike
    t0 = time.perf_counter()
    drivers = {"adaptive": start_mode("adaptive", base, corpus)}
    profile_path = Path(base.run_dir) / "adaptive" / "profile.json"
    print(f"calibration took {time.perf_counter() - t0:.0f} s; profile {profile_path}")
    base = dataclasses.replace(base, plan=dataclasses.replace(base.plan, profile=str(profile_path)))
    statics = []
    d = 1
    while d <= args.workers:
        statics += [f"static-{kind}-{d}" for kind in (("ulysses", "ring") if d > 1 else ("ulysses",))]
        d *= 2
    if args.static != "all":
        statics = [m for m in statics if m in args.static.split(",")]
    pipelined = [
        f"pp-{p}" + ("" if placement == "stage" else f"-{placement}")
        for p in args.pipeline.split(",")
        if p
        for placement in args.pipeline_params.split(",")
    ]
    for mode in statics + pipelined:
        drivers[mode] = start_mode(mode, base, corpus)
    results = [{"mode": m, "records": [], "profile": drv.profile} for m, drv in drivers.items()]
    t_steps = time.perf_counter()
    for i in range(steps):
        order = results[i % len(results) :] + results[: i % len(results)]
        for res in order:
            if "infeasible" not in res:
                step_mode(drivers[res["mode"]], res)
        eta = (time.perf_counter() - t_steps) / (i + 1) * (steps - i - 1)
        print(f"round {i + 1}/{steps} done, ETA {eta:.0f} s", flush=True)
    for drv in drivers.values():
        drv.shutdown()
    for res in results:
        res["records"] = res["records"][1:]  # the first step warms up (process groups, allocator)

    rows = [summarise(r) for r in results if "infeasible" not in r]
    adaptive = rows[0]
    statics = [r for r in rows[1:] if not r["mode"].startswith("pp-")]
    best = min(statics, key=lambda r: r["step_ms"]) if statics else None
    print()
    print(
        f"{'layout':<18s} {'step ms':>8s} {'adapt x':>8s} {'compute':>8s} {'pred':>8s} {'err':>6s} "
        f"{'act MB':>7s} {'pred MB':>7s} {'ovh':>6s} {'tok/s':>8s} {'bubble sim/meas':>15s} {'state MB':>8s} "
        f"{'move ms':>7s}"
    )
    for r in rows:
        bubble = "-" if r["bubble"] is None else f"{100 * r['bubble'][0]:.1f}%/{100 * r['bubble'][1]:.1f}%"
        state = "-" if r["state_mb"] is None else f"{r['state_mb']:.2f}"
        move = "-" if r["move_ms"] is None else f"{r['move_ms']:.1f}"
        print(
            f"{r['mode']:<18s} {r['step_ms']:8.1f} {r['step_ms'] / adaptive['step_ms']:7.2f}x {r['compute_ms']:8.1f} "
            f"{r['predicted_ms']:8.1f} {100 * r['pred_error']:5.1f}% {r['peak_act_mb']:7.2f} {r['pred_act_mb']:7.2f} "
            f"{100 * r['overhead']:5.1f}% {r['tokens_per_s']:8.0f} {bubble:>15s} {state:>8s} {move:>7s}"
        )
    for r in results:
        if "infeasible" in r:
            print(f"{r['mode']:<18s} infeasible: {r['infeasible']}")
    if best is not None:
        print(
            f"\nadaptive vs best static ({best['mode']}): {best['step_ms'] / adaptive['step_ms']:.2f}x (target >= 1.3x)"
        )
    print(
        f"adaptive prediction error (median |pred - compute| / compute): {100 * adaptive['pred_error']:.1f} % "
        "(target <= 15 %)"
    )
    print(f"driver overhead (dispatch + bookkeeping) per step: {100 * adaptive['overhead']:.1f} % (target < 5 %)")
    print(
        f"solve hidden behind the previous step: median solve {adaptive['solve_s'] * 1e3:.0f} ms, driver waited "
        f"{adaptive['plan_wait_ms']:.1f} ms for it"
    )
    (args.out / "results.json").write_text(
        json.dumps({"rows": rows, "args": vars(args) | {"out": str(args.out)}}, indent=1)
    )
    _picture(results[0], profile_path, args.out / "plans.svg")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'plans.svg'}")
    ray.shutdown()
    return 0


def _picture(result: dict, profile_path: Path, out: Path) -> None:
    from flexorch.dashboards.plan_svg import render_steps_svg
    from flexorch.solver.plan import Group, MicroBatch, Plan
    from flexorch.solver.profiles import get_profile
    from flexorch.solver.step_planner import planner_profile

    recs = result["records"][:4]
    prof = get_profile(str(profile_path))
    prof = planner_profile(
        prof, num_heads=prof.num_heads, num_kv_heads=prof.num_kv_heads, tokens_per_worker=10**9
    )  # the picture only needs times
    panels = []
    for r in recs:
        mbs = [
            MicroBatch(tuple(Group(g["degree"], g["kind"], tuple(g["ranks"]), tuple(g["seq_ids"])) for g in mb))
            for mb in r["plan"]["micro_batches"]
        ]
        plan = Plan(
            num_devices=r["world_size"],
            seq_lengths=tuple(r["seq_lengths"]),
            micro_batches=tuple(mbs),
            tokens_per_device=10**9,
            num_heads=prof.num_heads,
        )
        panels.append(
            (
                f"step {r['step']}: {r['shape']}  predicted {r['predicted_ms']:.0f} ms, measured compute "
                f"{r['compute_ms']:.0f} ms",
                plan,
            )
        )
    out.write_text(render_steps_svg(panels, prof))


if __name__ == "__main__":
    raise SystemExit(run_main(main, "measured/train"))
