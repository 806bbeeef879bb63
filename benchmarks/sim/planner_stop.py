"""What the planner's stop at the bound saves (a benchmark, not a test): each batch planned twice, side by side.

Issue 48 found the demo's step predictions off by the CPU the planner takes: the next step's plan is solved on the
same cores while a step runs, and on the demo (4 CPU workers on 2 cores) it used the whole 0.5 s budget on batches
whose first start was already optimal. ``PlannerConfig.stop_at_bound`` stops where the answer is proven within the
bisection's tolerance (1 %) of optimal: a micro-batch whose start is within it of its lower bound is not solved, and
no further split is tried once the best plan is within it of the step's bound. Per batch, interleaved in one run:

- ``stop``: the planner as a run has it (``stop_at_bound=True``);
- ``full``: the same batch with ``stop_at_bound=False`` (every micro-batch solved, every split tried while time is
  left): what the planner did before.

Columns: the wall time of the plan call (the planner's process and its solver process take turns, so this is about
the CPU the plan takes from the machine), the predicted step time and the gap to the step's proven bound.

Settings: ``run``, the batches a training run planned (``--run-dir``, default ``runs/train``: what ``make demo``
writes) with the newest profile it planned with (``profile_revisions.jsonl``) at its budget (``config.json``);
``wiki64``, FlexSP's setting (gpt-7b-a100 with 64 heads, the bundled Wikipedia lengths up to 384K, N=64, batch
512, 1 s), where few batches reach the bound and the two should plan alike; ``scale1024`` (``--settings``),
``benchmarks/sim/plan_scale.py``'s 1,024 devices with batches of 4,096 Wikipedia lengths at 1 s.

    python -m benchmarks.sim.planner_stop                          # after `make demo`: about a minute
    python -m benchmarks.sim.planner_stop --settings run,wiki64 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from benchmarks.common import ROOT, run_main  # noqa: E402
from flexorch.data.lengths import bundled_lengths_path, read_lengths  # noqa: E402
from flexorch.data.stream import DocumentStream  # noqa: E402
from flexorch.solver import PlannerConfig, get_profile  # noqa: E402
from flexorch.solver.profiles import profile_from_dict  # noqa: E402
from flexorch.solver.step_planner import StepPlanner  # noqa: E402
from flexorch.solver.validation import largest_degree  # noqa: E402


def run_setting(run_dir: Path, steps: int):
    """(profile, [(lengths, workers)], budget s) of the run in ``run_dir``: its steps' batches, its newest profile."""
    records, revisions = run_dir / "steps.jsonl", run_dir / "profile_revisions.jsonl"
    if not records.is_file() or not revisions.is_file() or not revisions.read_text().strip():
        raise SystemExit(
            f"{run_dir} has no steps.jsonl with profile revisions: run `make demo` (or flexorch train) first, or "
            "pass --run-dir of a run with a calibrated profile"
        )
    last = [json.loads(line) for line in revisions.read_text().splitlines() if line.strip()][-1]
    profile = profile_from_dict(last["profile"], where=str(revisions))
    recs = [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
    batches = [(r["seq_lengths"], r["world_size"]) for r in recs if r.get("seq_lengths") and not r.get("skipped")]
    budget = json.loads((run_dir / "config.json").read_text())["plan"]["time_limit_s"]
    return profile, batches[:steps], float(budget)


def wiki64_setting(steps: int):
    profile = get_profile("gpt-7b-a100").with_overrides(num_heads=64, num_kv_heads=64)
    data = read_lengths(bundled_lengths_path())
    data = data[(data > 0) & (data <= 384 * 1024)]
    stream = DocumentStream(data.size, 512, seed=0)
    return profile, [(data[list(stream.next_batch().doc_ids)].tolist(), 64) for _ in range(steps)], 1.0


def scale_setting(steps: int):
    """``benchmarks/sim/plan_scale.py``'s first setting: 1,024 devices, batches of 4,096 Wikipedia lengths, 1 s."""
    profile = get_profile("gpt-7b-a100")
    data = read_lengths(bundled_lengths_path())
    data = data[(data > 0) & (data <= largest_degree(1024) * profile.tokens_per_device)]
    stream = DocumentStream(data.size, 4096, seed=0)
    return profile, [(data[list(stream.next_batch().doc_ids)].tolist(), 1024) for _ in range(steps)], 1.0


def compare(name: str, profile, batches, budget: float) -> dict:
    """Plan every batch with and without the stop, one after the other; print a row per batch and a summary."""
    planners = {
        stop: StepPlanner(profile, PlannerConfig(time_limit_s=budget, stop_at_bound=stop)) for stop in (True, False)
    }
    for planner in planners.values():  # warm: the solver process starts, the first tables are built
        planner.plan(batches[0][0], batches[0][1])
    print(f"\n{name}: {len(batches)} batches, budget {budget} s, profile {profile.name}")
    head = f"{'batch':>5} {'stop ms':>8} {'full ms':>8} {'pred stop':>10} {'pred full':>10} {'ratio':>6}"
    print(f"{head}  gap stop / full")
    rows = []
    for i, (lengths, n) in enumerate(batches):
        got = {}
        for stop, planner in planners.items():
            t = time.perf_counter()
            p = planner.plan(lengths, n)
            got[stop] = (time.perf_counter() - t, p.predicted_ms, p.gap or 0.0)
        (ws, ps, gs), (wf, pf, gf) = got[True], got[False]
        rows.append((ws, wf, ps / pf))
        print(f"{i:>5} {ws * 1e3:>8.1f} {wf * 1e3:>8.1f} {ps:>10.1f} {pf:>10.1f} {ps / pf:>6.3f}  {gs:.1%} / {gf:.1%}")
    a = np.array(rows)
    out = {
        "stop_ms": float(np.median(a[:, 0]) * 1e3),
        "full_ms": float(np.median(a[:, 1]) * 1e3),
        "ratio_median": float(np.median(a[:, 2])),
        "ratio_worst": float(a[:, 2].max()),
    }
    print(
        f"{name}: plan wall time median {out['stop_ms']:.0f} ms with the stop, {out['full_ms']:.0f} ms without "
        f"({out['full_ms'] / out['stop_ms']:.1f}x); predicted step with/without: median {out['ratio_median']:.3f}, "
        f"worst {out['ratio_worst']:.3f}"
    )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="run,wiki64", help="comma-separated: run, wiki64, scale1024")
    ap.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "train", help="the run of the 'run' setting")
    ap.add_argument("--steps", type=int, default=20, help="batches per setting (default 20)")
    args = ap.parse_args(argv)
    for name in args.settings.split(","):
        if name == "run":
            compare(f"run {args.run_dir}", *run_setting(args.run_dir, args.steps))
        elif name == "wiki64":
            compare("wiki64", *wiki64_setting(args.steps))
        elif name == "scale1024":
            compare("scale1024", *scale_setting(args.steps))
        else:
            raise SystemExit(f"unknown setting {name!r}: use run, wiki64 and/or scale1024")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "sim/planner_stop"))
