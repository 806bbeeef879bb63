"""Planner benchmark (not a test): plan quality and solve time on real lengths, side by side in one run.

Part 1, FlexSP's setting (docs/design.md §2.4): shipped Wikipedia lengths, profile gpt-7b-a100, N=64, 384K context,
global batch 512, 20 steps. Per step: solve time, predicted step time, gap to the proven bound, and speedups vs
static Ulysses SP=64 (DeepSpeed's setting at 384K; GPT-7B's 32 heads of 128 taken as 64 heads of 64 so that
Ulysses-64 exists, same hidden size, so the same FLOPs and bytes), the best static ring degree, and BatchAda.

Part 2, scaling: N in {16, 64, 256, 1024} x batch in {128, 512, 2048}: solve time and gap.

    python -m benchmarks.sim.planner            # both parts (about 2-4 minutes on one core)
    python -m benchmarks.sim.planner --quick    # fewer steps, smaller grid
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
from flexorch.solver import Planner, PlannerConfig, baseline_times_ms, get_profile  # noqa: E402
from flexorch.solver.validation import largest_degree  # noqa: E402


def part1(steps: int, time_limit: float) -> None:
    profile = get_profile("gpt-7b-a100").with_overrides(num_heads=64, num_kv_heads=64)
    data = read_lengths(bundled_lengths_path())
    data = data[(data > 0) & (data <= 384 * 1024)]
    stream = DocumentStream(data.size, 512, seed=0)
    rows = []
    print(
        f"Part 1: Wikipedia lengths, {profile.name} (64 heads), N=64, 384K context, batch 512, {steps} steps, "
        f"time limit {time_limit} s/step, one process"
    )
    print(
        f"{'step':>4} {'solve_s':>8} {'plan_ms':>8} {'bound_ms':>8} {'gap':>6} {'vs U-64':>8} {'vs ring*':>9} "
        f"{'vs BatchAda':>11}  shape"
    )
    t0 = time.perf_counter()
    with Planner(profile, PlannerConfig(time_limit_s=time_limit)) as planner:
        for step in range(steps):
            batch = data[list(stream.next_batch().doc_ids)]
            r = planner.plan(batch, 64)
            base = baseline_times_ms(batch, 64, profile)
            ring = min(v for k, v in base.items() if k.startswith("static-ring-") and v is not None)
            row = (
                r.solve_s,
                r.predicted_ms,
                r.bound_ms,
                r.gap,
                base["static-ulysses-64"] / r.predicted_ms,
                ring / r.predicted_ms,
                base["batchada"] / r.predicted_ms,
            )
            rows.append(row)
            eta = (time.perf_counter() - t0) / (step + 1) * (steps - step - 1)
            print(
                f"{step:>4} {row[0]:>8.3f} {row[1]:>8.0f} {row[2]:>8.0f} {row[3] * 100:>5.1f}% {row[4]:>7.2f}x "
                f"{row[5]:>8.2f}x {row[6]:>10.3f}x  {r.plan.shape()}   (eta {eta:.0f} s)",
                flush=True,
            )
    a = np.array(rows)
    print(
        f"\nsummary: solve median {np.median(a[:, 0]):.3f} s, p95 {np.percentile(a[:, 0], 95):.3f} s | gap median "
        f"{np.median(a[:, 3]) * 100:.1f} %, max {a[:, 3].max() * 100:.1f} % | speedup median vs static "
        f"Ulysses-64 {np.median(a[:, 4]):.2f}x, vs best static ring {np.median(a[:, 5]):.2f}x, vs BatchAda "
        f"{np.median(a[:, 6]):.3f}x (mean {a[:, 6].mean():.3f}x, worse than BatchAda on "
        f"{int((a[:, 6] < 1 - 1e-9).sum())} of {len(a)} steps)\n"
    )


def part2(devices, batches, steps: int, time_limit: float) -> None:
    profile = get_profile("gpt-7b-a100")
    data = read_lengths(bundled_lengths_path())
    data = data[data > 0]
    print(
        f"Part 2: scaling, {profile.name}, context = min(384K, what N devices hold), {steps} steps per cell, "
        f"time limit {time_limit} s/step"
    )
    print(
        f"{'N':>5} {'batch':>6} {'solve med s':>11} {'solve max s':>11} {'gap med':>8} {'gap max':>8} "
        f"{'micro-batches':>13}"
    )
    for n in devices:
        limit = min(384 * 1024, largest_degree(n) * profile.tokens_per_device)
        pool = data[data <= limit]
        for b in batches:
            stream = DocumentStream(pool.size, b, seed=1)
            solve, gap, mbs = [], [], []
            with Planner(profile, PlannerConfig(time_limit_s=time_limit)) as planner:
                for _ in range(steps):
                    r = planner.plan(pool[list(stream.next_batch().doc_ids)], n)
                    solve.append(r.solve_s)
                    gap.append(r.gap)
                    mbs.append(len(r.plan.micro_batches))
            print(
                f"{n:>5} {b:>6} {np.median(solve):>11.3f} {max(solve):>11.3f} {np.median(gap) * 100:>7.1f}% "
                f"{max(gap) * 100:>7.1f}% {np.median(mbs):>13.0f}",
                flush=True,
            )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 steps, small grid")
    ap.add_argument("--time-limit", type=float, default=1.0, help="planner budget per step (s)")
    ap.add_argument("--skip-scaling", action="store_true")
    args = ap.parse_args(argv)
    part1(5 if args.quick else 20, args.time_limit)
    if not args.skip_scaling:
        if args.quick:
            part2([16, 64], [128, 512], 2, args.time_limit)
        else:
            part2([16, 64, 256, 1024], [128, 512, 2048], 3, args.time_limit)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "sim/planner"))
