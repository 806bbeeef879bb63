"""Planning at cluster scale (a benchmark, not a test): solve time against the budget and the gap to the proven bound.

Settings as `flexorch plan` runs them (``flexorch.cli.plan``): the bundled Wikipedia lengths, profile gpt-7b-a100,
context what the largest SP group of N workers holds, batches from the train driver's stream (seed 0), every step
through :class:`~flexorch.solver.step_planner.StepPlanner` with ``PlannerConfig(time_limit_s=budget)`` (solves in
the planner's solver process, baselines included). Solve time is the whole ``StepPlanner.plan`` call, measured
outside it.

    python -m benchmarks.sim.plan_scale              # 1,024 devices x 4,096 sequences (1 s), 4,096 x 16,384 (3 s)
    python -m benchmarks.sim.plan_scale --steps 3    # fewer steps
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from benchmarks.common import run_main  # noqa: E402
from flexorch.data.lengths import bundled_lengths_path, read_lengths  # noqa: E402
from flexorch.data.stream import DocumentStream  # noqa: E402
from flexorch.solver.planner import PlannerConfig  # noqa: E402
from flexorch.solver.profiles import get_profile  # noqa: E402
from flexorch.solver.step_planner import StepPlanner  # noqa: E402
from flexorch.solver.validation import largest_degree  # noqa: E402

SETTINGS = [(1024, 4096, 1.0), (4096, 16384, 3.0)]


def run(devices: int, batch: int, budget: float, steps: int, verbose: bool) -> dict:
    profile = get_profile("gpt-7b-a100")
    raw = read_lengths(bundled_lengths_path())
    lengths = raw[(raw > 0) & (raw <= largest_degree(devices) * profile.tokens_per_device)]
    stream = DocumentStream(lengths.size, batch, 0)
    solve, gap, statuses = [], [], []
    with StepPlanner(profile, PlannerConfig(time_limit_s=budget)) as planner:
        for step in range(steps):
            seqs = lengths[list(stream.next_batch().doc_ids)]
            t = time.perf_counter()
            out = planner.plan(seqs, devices)
            solve.append(time.perf_counter() - t)
            gap.append(out.predicted_ms / out.bound_ms - 1.0)
            statuses.append(out.status)
            if verbose:
                print(
                    f"  N={devices} batch={batch} step {step}: {solve[-1]:.3f} s, gap {gap[-1] * 100:.2f} %, "
                    f"{out.status}, {len(out.plan.micro_batches)} micro-batch(es), crashes {out.solver_crashes}"
                    + (f", {out.fallback_reason}" if out.fallback_reason else ""),
                    flush=True,
                )
    return {"solve": np.array(solve), "gap": np.array(gap), "statuses": statuses}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--verbose", action="store_true", help="one line per step")
    args = ap.parse_args(argv)
    rows = []
    for devices, batch, budget in SETTINGS:
        r = run(devices, batch, budget, args.steps, args.verbose)
        counts = {s: r["statuses"].count(s) for s in sorted(set(r["statuses"]))}
        rows.append((f"{devices} devices x {batch} seqs", budget, r, counts))
    print(
        f"\nplan_scale: bundled Wikipedia lengths, gpt-7b-a100, StepPlanner (whole call timed), {os.cpu_count()} CPUs"
    )
    print(
        f"{'setting':<28} {'steps':>5} {'budget s':>8} {'solve med s':>11} {'solve max s':>11} {'gap med':>8} "
        f"{'gap max':>8}  statuses"
    )
    for name, budget, r, counts in rows:
        print(
            f"{name:<28} {r['solve'].size:>5} {budget:>8.1f} {np.median(r['solve']):>11.3f} {r['solve'].max():>11.3f} "
            f"{np.median(r['gap']) * 100:>7.2f}% {r['gap'].max() * 100:>7.2f}%  "
            + ", ".join(f"{k} {v}" for k, v in counts.items())
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "sim/plan_scale"))
