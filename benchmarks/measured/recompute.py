"""Recompute modes at one memory budget, measured side by side on real CPU workers: full, selective, none and 'auto'
(``flexorch.solver.recompute``) train the same model on the same batches (same seed, same stream), adaptive plans.

The budget is one number of activation bytes per worker for every mode: what ``--tokens-per-worker`` tokens take
at full recompute's bytes. 'auto' runs first and measures what a token keeps without recompute and with selective
recompute (``none_act_ratio``, ``selective_act_ratio``); the fixed modes then get the same bytes in their own tokens
(:func:`same_bytes`), so a mode that keeps more per token holds fewer tokens. Each mode calibrates its own profile
(its bytes and times are its own). A mode that cannot run a batch (a document longer than the world holds in it) is
reported infeasible. The drivers stay up and take their steps in turn (rotating the order) so noise hits them alike.

Prints per mode: median step ms and its ratio to 'auto', median compute ms and the cost model's prediction, the
peak activation bytes a worker held, tokens/s; for 'auto' how its groups ran. Workload: measured/train.py's (Wikipedia
lengths scaled to a CPU context, filled with the standard library's text).

    python -m benchmarks.measured.recompute              # ~5 minutes on 2 cores
    python -m benchmarks.measured.recompute --steps 4    # quicker
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT, run_main, start_local_ray  # noqa: E402
from benchmarks.measured.train import step_mode, workload_config  # noqa: E402
from flexorch.config import TrainConfig  # noqa: E402
from flexorch.config.sharding import ShardingSettings  # noqa: E402
from flexorch.control.driver import TrainingDriver  # noqa: E402

MODES = ("auto", "full", "selective", "none")


def same_bytes(profile, ratio: float) -> int:
    """``tokens_per_worker`` that gives a mode keeping ``ratio`` x full's bytes per token the activation bytes
    ``profile`` (the 'auto' run's planner profile) has: the planner budgets ``(tokens + 0.5)`` x the costliest bytes
    per local token (a Ulysses group's, with its all-to-all copies; ``solver.step_planner.planner_profile``)."""
    room = profile.memory_budget_bytes - profile.model_state_bytes
    d, extra = 2, 0.0
    while d <= profile.num_heads:
        extra = max(extra, profile.act_bytes_per_local_token("ulysses", d) - profile.act_bytes_per_token)
        d *= 2
    return int(room / (ratio * profile.act_bytes_per_token + extra) - 0.5)


def start(mode: str, base: TrainConfig, corpus, tokens: int) -> TrainingDriver:
    cfg = dataclasses.replace(
        base,
        run_dir=str(Path(base.run_dir) / mode),
        sharding=ShardingSettings(activation_checkpointing=mode),
        plan=dataclasses.replace(base.plan, tokens_per_worker=tokens),
    )
    driver = TrainingDriver(cfg, corpus=corpus)
    driver.setup()
    return driver


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32, help="documents per global batch")
    ap.add_argument("--steps", type=int, default=8, help="steps per mode (the first is a warm-up)")
    ap.add_argument("--scale", type=float, default=4.0, help="divide Wikipedia lengths by this")
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--tokens-per-worker", type=int, default=1024, help="the budget, in full recompute's tokens")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--time-limit", type=float, default=0.3, help="planner budget per step, seconds")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_recompute")
    args = ap.parse_args(argv)

    start_local_ray(len(MODES) * args.workers + 2)
    base, corpus = workload_config(args, args.steps)
    t0 = time.perf_counter()
    drivers = {"auto": start("auto", base, corpus, args.tokens_per_worker)}
    p = drivers["auto"].profile
    tokens = {"auto": args.tokens_per_worker, "full": args.tokens_per_worker}
    tokens.update({m: same_bytes(p, r) for m, r in (("selective", p.selective_act_ratio), ("none", p.none_act_ratio))})
    print(
        f"'auto' measured: none keeps {p.none_act_ratio:.2f}x full's bytes at {p.none_time_ratio:.3f} of its time, "
        f"selective {p.selective_act_ratio:.2f}x at {p.selective_time_ratio:.3f}; the budget in each mode's tokens: "
        f"{tokens}",
        flush=True,
    )
    results = [{"mode": "auto", "records": []}]
    for mode in MODES[1:]:
        try:
            drivers[mode] = start(mode, base, corpus, tokens[mode])
            results.append({"mode": mode, "records": []})
        except Exception as e:  # noqa: BLE001 - a budget a mode cannot start with is a result
            results.append({"mode": mode, "records": [], "infeasible": f"{type(e).__name__}: {e}"[:200]})
    print(f"setup (five calibrations) took {time.perf_counter() - t0:.0f} s", flush=True)
    for i in range(args.steps):
        order = results[i % len(results) :] + results[: i % len(results)]
        for res in order:
            if "infeasible" not in res:
                step_mode(drivers[res["mode"]], res)
    for drv in drivers.values():
        drv.shutdown()
    auto_ms = None
    rows = []
    for res in results:
        if "infeasible" in res:
            rows.append(f"| {res['mode']} | {tokens[res['mode']]} | infeasible: {res['infeasible'][:120]} |")
            continue
        recs = res["records"][1:]  # the first step warms up
        step = float(np.median([r["measured_ms"] for r in recs]))
        auto_ms = step if res["mode"] == "auto" else auto_ms
        peak = max(max(x["peak_activation_bytes"] for x in r["ranks"] if x) for r in recs) / 1e6
        modes = [m for r in recs for row in r.get("recompute") or [] for m in row]
        ran = ", ".join(f"{m} {modes.count(m)}" for m in ("none", "selective", "full") if m in modes) or "-"
        packed = [(r.get("recompute_packing") or {}).get("packing") for r in recs]
        packed = ", ".join(f"{m} {packed.count(m)}" for m in ("full", "none", "selective") if m in packed) or "-"
        compute, predicted = (np.median([r[k] for r in recs]) for k in ("compute_ms", "predicted_ms"))
        rows.append(
            f"| {res['mode']} | {tokens[res['mode']]} | {step:,.0f} | {step / auto_ms:.2f}x | "
            f"{compute:,.0f} | {predicted:,.0f} | "
            f"{peak:.2f} | {np.median([r['tokens_per_s'] for r in recs]):,.0f} | {ran} | {packed} |"
        )
    print()
    print("| mode | tokens per worker | step ms | x auto | compute ms | predicted ms | peak act MB | tok/s | groups | "
          "packed for |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "measured/recompute"))
