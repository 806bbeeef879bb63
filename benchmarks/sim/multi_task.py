"""Several fine-tuning tasks in one step (a benchmark, not a test): Spindle's plan against tasks in turn and a fixed
split, on the same batches and cost model (issue 35; Spindle, arXiv 2409.03365, §6).

Per setting (devices x tasks) and step, each task draws its batch (seeded) from one of two length pools, the bundled
Wikipedia lengths (FlexSP's public release) and a code set (the byte lengths of the Python standard library's
``.py`` files divided by 3.5, about a code tokenizer's tokens), each capped at what the largest SP group of N
devices holds; batch sizes and LoRA ranks differ per task. Profile gpt-7b-a100 (FlexSP's A100 constants), all 32
layers shared, adapters on them. Every plan comes from ``flexorch.solver.multitask.plan_tasks`` (timed whole:
MetaOp time tables, allocation, search, baselines, validation) and is priced by the same cost model:

- ``in turn``: each task on all N devices, one after another;
- ``fixed split``: each task on its own power-of-two block for the step (``multitask.baselines``); n/a when the
  tasks' fewest devices add up to more than N in some step (a task whose longest sequence needs the whole cluster);
- ``Spindle``: the plan; ``bound``: the continuous optimum C*, a proven lower bound; gap = Spindle / bound - 1.

Times are summed over the steps; speedups are ratios of those sums.

    python -m benchmarks.sim.multi_task             # 64 and 256 devices x 3, 5, 8 tasks, 3 steps each
    python -m benchmarks.sim.multi_task --quick     # one small setting, one step (a smoke run)
    python -m benchmarks.sim.multi_task --svg plan.svg --svg-row 64:5   # also draw that row's first step
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
from flexorch.solver.multitask import TaskBatch, plan_tasks  # noqa: E402
from flexorch.solver.profiles import get_profile  # noqa: E402
from flexorch.solver.validation import largest_degree  # noqa: E402

BATCHES = (32, 64, 128, 256, 512)
RANKS = (8, 16, 64, 128, 256)
CODE_BYTES_PER_TOKEN = 3.5


def code_lengths() -> np.ndarray:
    """Token counts of the standard library's ``.py`` files: bytes / 3.5."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sizes = np.array([p.stat().st_size for p in root.rglob("*.py") if "site-packages" not in p.parts], dtype=float)
    return np.maximum(1, np.round(sizes[sizes > 0] / CODE_BYTES_PER_TOKEN)).astype(np.int64)


def draw_tasks(pools: dict[str, np.ndarray], num_tasks: int, rng: np.random.Generator) -> list[TaskBatch]:
    """Task i draws from pool i % 2 (code, wiki), with its own batch size and adapter rank."""
    names = sorted(pools)
    tasks = []
    for i in range(num_tasks):
        source = names[i % len(names)]
        batch = int(rng.choice(BATCHES))
        tasks.append(
            TaskBatch(
                name=f"{source}{i}",
                lengths=tuple(int(s) for s in rng.choice(pools[source], batch)),
                adapter_rank=int(rng.choice(RANKS)),
            )
        )
    return tasks


def run(devices: int, num_tasks: int, steps: int, seed: int) -> dict:
    profile = get_profile("gpt-7b-a100")
    cap = largest_degree(devices) * profile.tokens_per_device
    wiki, code = read_lengths(bundled_lengths_path()), code_lengths()
    pools = {"wiki": wiki[(wiki > 0) & (wiki <= cap)], "code": code[code <= cap]}
    rng = np.random.default_rng([seed, devices, num_tasks])
    out = {"in_turn": 0.0, "fixed_split": 0.0, "spindle": 0.0, "bound": 0.0, "solve": [], "gap": [], "method": []}
    for step in range(steps):
        tasks = draw_tasks(pools, num_tasks, rng)
        t = time.perf_counter()
        plan = plan_tasks(tasks, devices, profile)
        out["solve"].append(time.perf_counter() - t)
        out["in_turn"] += plan.baselines_ms["in_turn"]
        out["fixed_split"] += plan.baselines_ms["fixed_split"]
        out["spindle"] += plan.makespan_ms
        out["bound"] += plan.bound_ms
        out["gap"].append(plan.gap)
        out["method"].append(plan.method)
        if step == 0:
            out["first"] = (plan, [task.name for task in tasks])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="64 devices x 3 tasks, one step")
    ap.add_argument("--svg", type=Path, help="write the picture of the first step of the first row (or --svg-row)")
    ap.add_argument("--svg-row", help="DEVICES:TASKS, the row --svg draws (one of the rows run)")
    args = ap.parse_args(argv)
    settings = [(64, 3)] if args.quick else [(n, t) for n in (64, 256) for t in (3, 5, 8)]
    svg_row = settings[0]
    if args.svg_row:
        svg_row = tuple(int(x) for x in args.svg_row.split(":") if x.isdigit())
        if svg_row not in settings:
            ap.error(f"--svg-row {args.svg_row} is not one of the rows run: {settings}")
    steps = 1 if args.quick else args.steps
    print(
        f"\nmulti_task: gpt-7b-a100, Wikipedia + code lengths, {steps} step(s) per row (times summed), "
        f"seed {args.seed}, {os.cpu_count()} CPUs"
    )
    print(
        "| devices | tasks | in-turn ms | fixed-split ms | Spindle ms | vs in-turn | vs fixed split | bound ms "
        "| gap % (max) | planner s (max) | plans |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for devices, num_tasks in settings:
        r = run(devices, num_tasks, steps, args.seed)
        methods = ", ".join(f"{m} {r['method'].count(m)}" for m in sorted(set(r["method"])))
        split = f"{r['fixed_split']:.0f}" if np.isfinite(r["fixed_split"]) else "n/a"
        split_x = f"{r['fixed_split'] / r['spindle']:.2f}x" if np.isfinite(r["fixed_split"]) else "n/a"
        print(
            f"| {devices} | {num_tasks} | {r['in_turn']:.0f} | {split} | {r['spindle']:.0f} "
            f"| {r['in_turn'] / r['spindle']:.2f}x | {split_x} | {r['bound']:.0f} "
            f"| {(r['spindle'] / r['bound'] - 1) * 100:.1f} ({max(r['gap']) * 100:.1f}) | {max(r['solve']):.3f} "
            f"| {methods} |",
            flush=True,
        )
        if args.svg and (devices, num_tasks) == svg_row:
            from flexorch.testing.multitask_svg import multitask_svg

            plan, names = r["first"]
            title = f"multi_task.py seed {args.seed}, {devices} devices x {num_tasks} tasks, step 1 (gpt-7b-a100)"
            args.svg.write_text(multitask_svg(plan, task_names=names, title=title))
            print(f"(picture of {devices}x{num_tasks} step 1: {args.svg})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "sim/multi_task"))
