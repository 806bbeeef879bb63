"""Sliding-window models (a benchmark, not a test): plans that price a windowed layer's attention by its window
against plans of the quadratic cost model, both priced by the window-aware model.

A Gemma-3-like model: FlexSP's GPT-7B shape and A100 tables (profile ``gpt-7b-a100``, nodes of 8, NVLink inside,
InfiniBand across) with 5 of every 6 layers attending within a sliding window of 1K or 4K tokens and the sixth to
the whole document (Gemma 3's 5 local : 1 global). A windowed layer's attention over s tokens costs
``2 s w - w^2`` key-query pairs instead of ``s^2`` (``flexorch.solver.cost_model.attention_square``); everything
else (the linear terms, the all-to-alls and ring exchanges, the memory) is the quadratic model's.

Per step, on the same batch (``flexorch.data.stream.DocumentStream``, seed 0):

- ``global``: the all-global model of the same size (every layer full attention), planned and priced as itself:
  what the step costs without windows;
- ``blind``: the planner of the quadratic model (the window unknown to it, as a planner that prices ``s^2``
  everywhere), its plan then priced by the window-aware model: the step a windowed model runs on such a plan;
- ``aware``: ``StepPlanner.plan`` with the window in the profile (``Profile.attention_window``,
  ``Profile.window_fraction``): the same step planned knowing the window.

Columns: ``global/aware`` (what the window saves in all), ``blind/aware`` per step, median and worst (max; above 1:
the window-aware plan is faster), and the aware plans' SP degrees (the largest and the median over groups,
weighted by tokens): a long document of a windowed model needs fewer devices than the quadratic model gives it.

Lengths: the bundled Wikipedia lengths (FlexSP's public release) and ``code``, the byte lengths of the Python
standard library's ``.py`` files, both at most the setting's context, as ``benchmarks/sim/stragglers.py`` draws
them.

    python -m benchmarks.sim.windowed            # 4 steps of each setting (a few minutes)
    python -m benchmarks.sim.windowed --quick    # 1 step of each 64-GPU setting
    python -m benchmarks.sim.windowed --steps 2 --gpus 64

The planner's budget is wall time (1 s at 64 GPUs, 1.5 s at 256): on a loaded machine both planners find worse plans;
the results file gives the load.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from benchmarks.common import run_main  # noqa: E402
from benchmarks.sim.stragglers import lengths_of  # noqa: E402
from flexorch.data.stream import DocumentStream  # noqa: E402
from flexorch.solver import PlannerConfig, get_profile  # noqa: E402
from flexorch.solver.simulator import step_time_ms  # noqa: E402
from flexorch.solver.step_planner import StepPlanner  # noqa: E402
from flexorch.solver.topology import Topology  # noqa: E402
from flexorch.solver.validation import largest_degree  # noqa: E402

K = 1024
PER_NODE = 8
LOCAL_SHARE = 5 / 6  # Gemma 3: five sliding-window layers per global one
SETTINGS = (  # (GPUs, lengths, context, global batch, planner budget s)
    (64, "wiki", 384 * K, 512, 1.0),  # stragglers' / planner_quality's wiki64 (FlexSP's GPT-7B setting)
    (64, "code", 128 * K, 256, 1.0),
    (256, "wiki", 384 * K, 512, 1.5),
    (256, "code", 256 * K, 512, 1.5),
)
WINDOWS = (1 * K, 4 * K)
QUADRATIC = get_profile("gpt-7b-a100")


def degrees(plan) -> tuple[int, float]:
    """The largest SP degree of ``plan`` and the median degree a token runs at."""
    per_token = []
    for mb in plan.micro_batches:
        for g in mb.groups:
            per_token.append((g.degree, sum(plan.seq_lengths[i] for i in g.seq_ids)))
    ds = np.array([d for d, _ in per_token], dtype=float)
    weights = np.array([n for _, n in per_token], dtype=float)
    order = np.argsort(ds)
    cum = np.cumsum(weights[order])
    median = ds[order][np.searchsorted(cum, cum[-1] / 2)]
    return int(ds.max()), float(median)


def run_setting(gpus, source, context, batch, budget, steps) -> dict:
    """Every window's global, blind and aware step times per step on the same batches."""
    topo = Topology.uniform(gpus // PER_NODE, PER_NODE)
    data = lengths_of(source)
    data = data[(data > 0) & (data <= min(context, largest_degree(gpus) * QUADRATIC.tokens_per_device))]
    stream = DocumentStream(data.size, batch, seed=0)
    windowed = {w: QUADRATIC.with_overrides(attention_window=w, window_fraction=LOCAL_SHARE) for w in WINDOWS}
    out = {w: {"global": [], "blind": [], "aware": [], "top": [], "median_d": [], "blind_top": [], "solve": []}
           for w in WINDOWS}  # fmt: skip
    config = PlannerConfig(time_limit_s=budget)
    with StepPlanner(QUADRATIC, config) as quadratic:
        planners = {w: StepPlanner(p, config) for w, p in windowed.items()}
        try:
            for _ in range(steps):
                seqs = data[list(stream.next_batch().doc_ids)]
                blind = quadratic.plan(seqs, gpus, with_baselines=False, topology=topo).plan
                global_ms = step_time_ms(blind, QUADRATIC)
                for w, profile in windowed.items():
                    t0 = time.perf_counter()
                    aware = planners[w].plan(seqs, gpus, with_baselines=False, topology=topo).plan
                    o = out[w]
                    o["solve"].append(time.perf_counter() - t0)
                    o["global"].append(global_ms)
                    o["blind"].append(step_time_ms(blind, profile))
                    o["aware"].append(step_time_ms(aware, profile))
                    top, median = degrees(aware)
                    o["top"].append(top)
                    o["median_d"].append(median)
                    o["blind_top"].append(degrees(blind)[0])
        finally:
            for p in planners.values():
                p.close()
    return out


HEADER = (
    f"{'GPUs':>5} {'data':>5} {'ctx':>5} {'batch':>5} {'steps':>5} {'window':>6} {'global ms':>9} {'blind ms':>9} "
    f"{'aware ms':>9} {'global/aware':>12} {'blind/aware med':>15} {'worst':>6} {'min':>6} {'max d b/a':>9} "
    f"{'med d':>5} {'solve s':>7}"
)


def row(gpus, source, context, batch, steps, w, r) -> str:
    med = np.median
    ratio = np.array(r["blind"]) / np.array(r["aware"])
    saved = np.array(r["global"]) / np.array(r["aware"])
    return (
        f"{gpus:>5} {source:>5} {context // K:>4}K {batch:>5} {steps:>5} {w // K:>5}K {med(r['global']):>9.0f} "
        f"{med(r['blind']):>9.0f} {med(r['aware']):>9.0f} {med(saved):>11.2f}x {med(ratio):>14.3f}x "
        f"{ratio.max():>5.2f}x {ratio.min():>5.2f}x {max(r['blind_top']):>4}/{max(r['top']):<4} "
        f"{med(r['median_d']):>5.0f} {med(r['solve']):>7.2f}"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="steps per setting (default 4)")
    ap.add_argument("--gpus", type=int, action="append", choices=(64, 256), help="only these sizes (repeat)")
    ap.add_argument("--quick", action="store_true", help="1 step of each 64-GPU setting")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    sizes = set(args.gpus or ((64,) if args.quick else (64, 256)))
    print(
        f"windowed: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; gpt-7b-a100 shape, nodes of 8; "
        f"{LOCAL_SHARE:.3f} of the layers windowed (Gemma 3's 5 local : 1 global), windows "
        f"{', '.join(f'{w // K}K' for w in WINDOWS)}; planner budget 1 / 1.5 s"
    )
    print(HEADER)
    t0 = time.perf_counter()
    for gpus, source, context, batch, budget in SETTINGS:
        if gpus not in sizes:
            continue
        steps = 1 if args.quick else args.steps
        result = run_setting(gpus, source, context, batch, budget, steps)
        for w in WINDOWS:
            print(row(gpus, source, context, batch, steps, w, result[w]), flush=True)
    print(
        "global: the all-global model of the same size, its own plan; blind: the quadratic model's plan, priced with "
        "the window; aware: the window-aware plan (medians over the steps); global/aware: what the window saves; "
        "blind/aware: per step (>1: the window-aware plan is faster), median, worst (max) and min; max d b/a: the "
        "largest SP degree of the blind and the aware plans; med d: the aware plans' median degree per token; "
        "solve s: the aware plan's wall time (median)."
    )
    print(f"load at the end {os.getloadavg()[0]:.2f}; {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "sim/windowed"))
