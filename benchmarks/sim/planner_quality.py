"""Planner quality (a benchmark, not a test): where the gap between a plan and the proven bound comes from.

Issue 22's question: is flexorch's plan at its normal budget far from what a MILP solver given minutes would find,
and if so, is the loss in the micro-batch split, in the packing of each micro-batch, or in a loose bound? Per step,
on the same batch:

- ``plan``: the planner (``flexorch.solver.Planner``, its MILPs in its solver process) at the normal budget;
- ``x30``: the same planner given 30 times that budget;
- ``split*``: the split of ``plan`` kept, each of its micro-batches solved again by the bisection MILP
  (``solver.milp.solve_micro_batch``) with long limits (``--long`` s per micro-batch, 0.2 % bracket, 30 bisection
  steps, each MILP up to a quarter of that): how good the packing of that split can get;
- ``bound``: the proven lower bound (``solver.bounds.step_bound_ms``) every plan is measured against.

Each is priced by the same simulator (``solver.simulator.step_time_ms``). Reading the table: ``plan`` close to
``split*`` but far from the bound means the split or the bound is the problem; ``split*`` well under ``plan`` means the
packing is; ``x30`` well under ``plan`` means the budget is.

Settings: ``wiki64``, FlexSP's GPT-7B setting (profile gpt-7b-a100 with 64 heads, the bundled Wikipedia lengths up to
384K, N=64, global batch 512), and ``code256``, a code-length distribution: the byte lengths of the ``.py`` files of
the Python standard library this runs on (files as a byte-level tokenizer sees them), gpt-7b-a100, N=256, batch 1024.
Batches come from ``flexorch.data.stream.DocumentStream`` (seed 0), as in training.

    python -m benchmarks.sim.planner_quality                  # 5 steps per setting at 1 s (about 15 minutes on 2 cores)
    python -m benchmarks.sim.planner_quality --steps 2 --long 5 --settings wiki64
    python -m benchmarks.sim.planner_quality --old            # the same without issue 22's starts and splits
    python -m benchmarks.sim.planner_quality --no-rounds      # tiered splits not seeded by the rounds bound
    python -m benchmarks.sim.planner_quality --no-halves      # before and after issue 48's search, side by side

The bound is the same in every case (``solver.bounds``, ``solver.round_bounds``, ``solver.count_bounds``), so
``--old`` and ``--no-rounds`` against the default show what the mixed-layout starts (``solver.fill``), tiered splits
and splits seeded by the rounds bound did to the plans. ``--no-halves`` plans every batch twice, without and with
issue 48's search (``PlannerConfig.halves``: the slowest sequences on the groups they run on, one of N devices or
two of N/2 side by side, ``solver.halves``; squeezed tiered splits; groups split in half by the local search), each
at 1 s and at 30x, and ``split*`` for the second only (so the run takes about twice as long less the split*s).
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from benchmarks.common import run_main  # noqa: E402
from flexorch.data.lengths import bundled_lengths_path, read_lengths  # noqa: E402
from flexorch.data.stream import DocumentStream  # noqa: E402
from flexorch.solver import Planner, PlannerConfig, get_profile  # noqa: E402
from flexorch.solver.bounds import micro_batch_bound_ms  # noqa: E402
from flexorch.solver.group_tables import GroupTables  # noqa: E402
from flexorch.solver.milp import solve_micro_batch  # noqa: E402
from flexorch.solver.packing import group_types, layout_groups, time_table, type_caps, type_overheads  # noqa: E402
from flexorch.solver.plan import MicroBatch, Plan  # noqa: E402
from flexorch.solver.simulator import step_time_ms  # noqa: E402
from flexorch.solver.validation import largest_degree  # noqa: E402


def code_lengths() -> np.ndarray:
    """Byte lengths of the standard library's ``.py`` files (ships with every Python: a real code distribution)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sizes = [p.stat().st_size for p in root.rglob("*.py") if "site-packages" not in p.parts]
    return np.array([s for s in sizes if s > 0], dtype=np.int64)


def setting(name: str):
    """(profile, pool of lengths, N, batch size)."""
    if name == "wiki64":
        profile = get_profile("gpt-7b-a100").with_overrides(num_heads=64, num_kv_heads=64)
        data = read_lengths(bundled_lengths_path())
        return profile, data[(data > 0) & (data <= 384 * 1024)], 64, 512
    if name == "code256":
        profile = get_profile("gpt-7b-a100")
        data = code_lengths()
        return profile, data[data <= largest_degree(256) * profile.tokens_per_device], 256, 1024
    raise ValueError(f"unknown setting {name!r}")


def same_split(plan: Plan, lengths: np.ndarray, n: int, profile, long_s: float, solver: str) -> float:
    """The step time of ``plan``'s split with each micro-batch solved again with long limits (never worse than the
    plan's own packing of it: that is the start)."""
    types = group_types(n, profile, ("ulysses", "ring"))
    table = time_table(lengths, types, profile)
    caps, overheads = type_caps(types, profile), type_overheads(types, profile)
    deg = np.array([t.degree for t in types], dtype=np.float64)
    tables = GroupTables(types, table, lengths, n, caps, overheads)
    mbs = []
    for mb in plan.micro_batches:
        items = sorted(i for g in mb.groups for i in g.seq_ids)
        s = solve_micro_batch(
            items,
            tables,
            lower_bound_ms=micro_batch_bound_ms(table[items], deg, n, overheads),
            time_budget_s=long_s,
            tolerance=0.002,
            max_bisection_steps=30,
            ilp_time_limit_s=long_s / 4,
            solver=solver,
        )
        mbs.append(mb if s is None else MicroBatch(tuple(layout_groups(s.draft, types, range(len(lengths))))))
    again = Plan.for_profile(num_devices=n, seq_lengths=lengths, micro_batches=mbs, profile=profile)
    return min(step_time_ms(again, profile), step_time_ms(plan, profile))


def variants(old: bool = False, rounds: bool = True, halves: bool = True) -> list[tuple[str, dict]]:
    """The planners to run on the same batches, (label, PlannerConfig knobs) each; the last one is the default."""
    knobs = {"fill_starts": False, "tiered_splits": False} if old else {}  # --old: before issue 22's changes
    if not rounds:
        knobs["round_splits"] = False  # --no-rounds: tiered splits without the rounds bound's micro-batches
    label = "old" if old else ("no-rounds" if not rounds else "now")
    if not halves:  # --no-halves: before issue 48's search, side by side with it
        return [("no-halves", {**knobs, "halves": False}), (label, knobs)]
    return [(label, knobs)]


def run(
    name: str,
    steps: int,
    budget: float,
    long_s: float,
    solver: str,
    old: bool = False,
    rounds: bool = True,
    halves: bool = True,
) -> dict[str, list[dict]]:
    """Per planner variant (:func:`variants`), a row per step; ``split*`` for the last variant only."""
    profile, pool, n, batch = setting(name)
    stream = DocumentStream(pool.size, batch, seed=0)
    runs = variants(old, rounds, halves)
    print(
        f"\n[{name}] {profile.name} ({profile.num_heads} heads), N={n}, batch {batch}, pool {pool.size:,} lengths "
        f"(max {int(pool.max()):,}), budget {budget} s, x30 {30 * budget:g} s, split* {long_s:g} s per micro-batch"
        f" ({runs[-1][0]})"
    )
    print(
        f"{'step':>4} {'planner':>9} {'bound_ms':>9} {'plan_ms':>9} {'x30_ms':>9} {'split*_ms':>9} {'gap':>7} "
        f"{'gap x30':>8} {'gap split*':>10} {'x30/plan':>9} {'mbs':>4} {'mbs x30':>7}"
    )
    rows: dict[str, list[dict]] = {label: [] for label, _ in runs}
    t0 = time.monotonic()
    planners = []
    for label, knobs in runs:
        cfg = PlannerConfig(time_limit_s=budget, solver=solver, **knobs)
        long_cfg = PlannerConfig(time_limit_s=30 * budget, solver=solver, **knobs)
        planners.append((label, Planner(profile, cfg), Planner(profile, long_cfg)))
    try:
        for step in range(steps):
            lengths = pool[list(stream.next_batch().doc_ids)]
            for k, (label, quick, slow) in enumerate(planners):
                a = quick.plan(lengths, n)
                b = slow.plan(lengths, n)
                last = k == len(planners) - 1
                c = same_split(a.plan, lengths, n, profile, long_s, solver) if last and long_s > 0 else np.nan
                bound = a.bound_ms
                row = {
                    "bound": bound,
                    "plan": a.predicted_ms,
                    "x30": b.predicted_ms,
                    "split": c,
                    "mbs": len(a.plan.micro_batches),
                    "mbs30": len(b.plan.micro_batches),
                    "solve": a.solve_s,
                }
                rows[label].append(row)
                eta = (time.monotonic() - t0) / (step + 1) * (steps - step - 1)
                print(
                    f"{step:>4} {label:>9} {bound:>9.1f} {row['plan']:>9.1f} {row['x30']:>9.1f} {c:>9.1f} "
                    f"{(row['plan'] / bound - 1) * 100:>6.2f}% {(row['x30'] / bound - 1) * 100:>7.2f}% "
                    f"{(c / bound - 1) * 100:>9.2f}% {row['x30'] / row['plan']:>9.4f} {row['mbs']:>4} "
                    f"{row['mbs30']:>7}" + (f"   (eta {eta:.0f} s)" if last else ""),
                    flush=True,
                )
    finally:
        for _, quick, slow in planners:
            quick.close()
            slow.close()
    for label, got in rows.items():
        gap = lambda k, got=got: np.array([r[k] / r["bound"] - 1 for r in got]) * 100  # noqa: E731
        split = f"{np.median(gap('split')):.2f} %" if not np.isnan(gap("split")).any() else "-"
        print(
            f"{label}: median gap: plan {np.median(gap('plan')):.2f} %, x30 {np.median(gap('x30')):.2f} %, split* "
            f"{split} | worst step plan/x30 {max(r['plan'] / r['x30'] for r in got):.4f} | solve median "
            f"{np.median([r['solve'] for r in got]):.3f} s | gap per step (plan) "
            + " / ".join(f"{g:.2f}" for g in gap("plan"))
            + " %"
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5, help="steps per setting")
    ap.add_argument("--budget", type=float, default=1.0, help="the planner's normal budget per step (s)")
    ap.add_argument("--long", type=float, default=20.0, help="split*: seconds per micro-batch (0: skip split*)")
    ap.add_argument("--settings", default="wiki64,code256", help="comma-separated: wiki64, code256")
    ap.add_argument("--solver", default="highs", choices=("highs", "cbc"))
    ap.add_argument(
        "--old", action="store_true", help="the planner without mixed-layout starts and tiered splits (issue 22)"
    )
    ap.add_argument(
        "--no-rounds", action="store_true", help="tiered splits without the rounds bound's micro-batches as seeds"
    )
    ap.add_argument(
        "--no-halves",
        action="store_true",
        help="also the planner without issue 48's search (the slowest on the groups they run on, squeezed splits, "
        "groups split in halves), side by side on the same batches",
    )
    args = ap.parse_args(argv)
    print(f"planner quality: {os.cpu_count()} CPUs, MILP backend {args.solver}, load {os.getloadavg()[0]:.2f}")
    for name in args.settings.split(","):
        run(
            name.strip(),
            args.steps,
            args.budget,
            args.long,
            args.solver,
            args.old,
            not args.no_rounds,
            not args.no_halves,
        )
    print(f"load at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "sim/planner_quality"))
