"""'auto' recompute on one GPU (a benchmark, not a test): the planner's step time with full recompute everywhere, no
recompute, and 'auto' before and after it compared two packings (``flexorch.solver.recompute``), on the same
batches and the same cost model, side by side.

The cost model is a 1.1B Llama (TinyLlama's shape) on one H200, from what was measured there on 2026-11-26
(``benchmarks/results/gpu/gpu_profile_h200.md``, ``benchmarks/results/gpu/gpu_throughput_h200.md``):

* compute terms: the run's calibration (``a1 = 6.46e-7 ms/tok^2``, ``a2 = 0.00963 ms/tok``, ``b1 = 127 ms``,
  measured without recompute) divided by ``none_time_ratio`` to make them full recompute's; the refit of that run
  found ``b1 = 0``, so each setting runs at both;
* ``none_time_ratio = 1128.8 / 1452.4 = 0.777``: the compiled HF model's micro-batch of 40,596 tokens without
  and with full recompute;
* activation bytes per token: without recompute 1,326,276 (the calibration); with full recompute 133,043, the
  growth of the peak from 16,384 to 40,596 tokens (5.4 -> 8.4 GiB); ``none_act_ratio`` = 9.97.

Activation budgets are given, not measured (no GPU here): 110 GiB (an H200's ~139 GiB free less 16.4 GiB of model
state and ``tokens_per_worker = "auto"``'s margin, 10 % + 2 GiB), 53 GiB (the same on an H100's ~78 GiB), 24 GiB.
Batches: 16 documents drawn (seeded) from the Python standard library's sources with the byte tokenizer, split at
``max_context`` (what ``flexorch train``'s default corpus and ``benchmarks/gpu/gpu_throughput.py`` run), per step.

Columns: predicted ms per step summed over the steps; ``none`` is n/a when a document of some step does not fit one
GPU without recompute; ``auto before`` packs for full recompute's bytes and runs without recompute the groups that
fit (the planner until 2026-11-27); ``auto`` also plans the packing for the bytes without recompute (documents too
long for it in micro-batches of their own) and keeps the faster; ``saved`` = 1 - auto / full; ``packed none`` the
steps whose faster packing was the second; ``solve`` the planner's median seconds per step before / after.

    python -m benchmarks.sim.recompute_packing               # 8 steps per setting
    python -m benchmarks.sim.recompute_packing --steps 3     # quicker
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from benchmarks.common import run_main  # noqa: E402
from flexorch.solver.errors import PlanningError  # noqa: E402
from flexorch.solver.planner import PlannerConfig  # noqa: E402
from flexorch.solver.profiles import Profile  # noqa: E402
from flexorch.solver.recompute import choose_modes, none_bytes_profile, with_modes  # noqa: E402
from flexorch.solver.simulator import step_time_ms  # noqa: E402
from flexorch.solver.step_planner import StepPlanner  # noqa: E402

GIB = 2**30
TIME_RATIO = 1128.8 / 1452.4
ACT_NONE = 1_326_276.0
ACT_FULL = 3.0 * GIB / (40_596 - 16_384)


def h200_profile(budget_gib: float, b1_ms: float) -> Profile:
    """The measured 1.1B-on-H200 cost model with full recompute's terms and 'auto''s two ratios."""
    return Profile(
        name=f"h200-1.1b-{budget_gib:g}gib-b1-{b1_ms:g}",
        a1_ms=6.46e-7 / TIME_RATIO,
        a2_ms=0.00963 / TIME_RATIO,
        b1_ms=b1_ms / TIME_RATIO,
        act_bytes_per_token=ACT_FULL,
        memory_budget_bytes=budget_gib * GIB,
        num_layers=22,
        hidden=2048,
        num_heads=32,
        num_kv_heads=4,
        a2a_gbps={2: 100.0},
        none_act_ratio=ACT_NONE / ACT_FULL,
        none_time_ratio=TIME_RATIO,
    )


def stdlib_lengths(context: int) -> np.ndarray:
    """Document lengths of ``flexorch train``'s default corpus (the standard library, byte tokenizer) at ``context``."""
    import ray

    from flexorch.config import CorpusConfig
    from flexorch.data.corpus import load_corpus

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        return np.asarray(load_corpus(CorpusConfig(max_context=context)).lengths, dtype=np.int64)
    finally:
        ray.shutdown()


def plain(profile: Profile) -> Profile:
    return profile.with_overrides(none_act_ratio=0.0, none_time_ratio=1.0)


def one_step(lengths: list[int], auto: Profile, limit_s: float) -> dict:
    cfg = PlannerConfig(time_limit_s=limit_s)
    out = {}
    t0 = time.perf_counter()
    full = StepPlanner(plain(auto), cfg).plan(lengths, 1, with_baselines=False)
    out["solve_before"] = time.perf_counter() - t0
    out["full"] = step_time_ms(full.plan, plain(auto))
    out["auto_before"] = step_time_ms(with_modes(full.plan, choose_modes(full.plan, auto)), auto)
    try:
        none = StepPlanner(plain(none_bytes_profile(auto)), cfg).plan(lengths, 1, with_baselines=False)
        out["none"] = None if none.plan is None else auto.none_time_ratio * none.predicted_ms
    except PlanningError:
        out["none"] = None
    t0 = time.perf_counter()
    now = StepPlanner(auto, cfg).plan(lengths, 1, with_baselines=False)
    out["solve_after"] = time.perf_counter() - t0
    out["auto"] = now.predicted_ms
    out["packed_none"] = now.plan.meta["recompute_packing"]["packing"] == "none"
    modes = [m for row in now.plan.meta["recompute"] for m in row]
    out["groups"], out["none_groups"] = len(modes), modes.count("none")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--time-limit-s", type=float, default=1.0)
    args = ap.parse_args(argv)
    print(
        f"1.1B Llama on one H200 (measured cost model; none_time_ratio {TIME_RATIO:.3f}, "
        f"none_act_ratio {ACT_NONE / ACT_FULL:.2f}); {args.batch} documents per step, {args.steps} steps each; "
        "predicted ms summed over the steps",
        flush=True,
    )
    head = (
        "| context | act budget | b1 ms | full | none | auto before | auto | saved | packed none | groups without "
        "recompute | solve s before / after |"
    )
    rows = [head, "|" + "---|" * 11]
    for context in (16_384, 65_536):
        pool = stdlib_lengths(context)
        for budget in (110.0, 53.0, 24.0):
            for b1 in (127.0, 0.0):
                auto = h200_profile(budget, b1)
                rng = np.random.default_rng(0)
                steps = [one_step(rng.choice(pool, args.batch, replace=False).tolist(), auto, args.time_limit_s)
                         for _ in range(args.steps)]  # fmt: skip
                tot = {k: sum(s[k] for s in steps) for k in ("full", "auto_before", "auto")}
                none = None if any(s["none"] is None for s in steps) else sum(s["none"] for s in steps)
                groups, none_groups = sum(s["groups"] for s in steps), sum(s["none_groups"] for s in steps)
                saved = 100 - 100 * tot["auto"] / tot["full"]
                rows.append(
                    f"| {context:,} | {budget:g} GiB | {b1:g} | {tot['full']:,.0f} | "
                    + ("n/a" if none is None else f"{none:,.0f}")
                    + f" | {tot['auto_before']:,.0f} | {tot['auto']:,.0f} | {saved:.1f} %"
                    f" | {sum(s['packed_none'] for s in steps)} of {len(steps)} | {none_groups} of {groups} | "
                    f"{np.median([s['solve_before'] for s in steps]):.2f} / "
                    f"{np.median([s['solve_after'] for s in steps]):.2f} |"
                )
                print(rows[-1], flush=True)
    print("\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "sim/recompute_packing"))
