"""Sharded model state under a per-worker memory cap: the largest decoder each sharding mode trains, side by side.

Part 1, CPU workers (real Ray actors, ``--workers`` of them, default 4): a ``--cap-mb`` budget per worker for model
state. A model "trains under the cap" in a mode when the worker's measured resident state (parameters, gradients
and AdamW moments, ``state_bytes`` after real steps) plus what FSDP gathers in flight (the planner's
``flexorch.solver.model_state`` figure) fits. Decoders grow along a fixed ladder (width in steps of 64, head size
32, SwiGLU width 8/3 x dim; layers 2..``--max-layers``); the pure formula picks the largest candidate per mode
(replicate, fsdp, hsdp with ``--shard-size``), then that model trains a few steps in that mode to confirm the
measured bytes fit (measured vs formula printed). Then, at one common model (the largest replicate fits), the
three modes train the same batches in turn and their step times are compared (ratio to replicate).

Targets: fsdp trains a model with >= 3.5x the parameters replicate can; at the same model, fsdp's step time is at
most 1.3x replicate's on CPU.

Part 2, FlexSP's setting simulated (GPT-7B/13B/30B profiles, 64 A100s, 384K context, Wikipedia lengths, batch
512): plans with the profile's assumption (model state outside the 28 GB activation budget, ``model_state_bytes``
0) against the executor's real figure (fsdp over 64 workers in bf16: resident 1/64 of 16 bytes per parameter plus
the root and one layer gathered in flight), both inside the 28 GB budget and inside the whole 40 GB device;
predicted step times and the speedup over the best static layout each way.

    python -m benchmarks.measured.memory            # about 5 minutes on 2 cores
    python -m benchmarks.measured.memory --quick    # fewer steps (same cap), one batch per GPT model
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import textwrap
import time
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT, run_main, start_local_ray  # noqa: E402
from benchmarks.measured.fixed_profile import write_fixed_profile  # noqa: E402
from flexorch.config import (  # noqa: E402
    CorpusConfig,
    ModelConfig,
    OptimConfig,
    PlanSettings,
    TrainConfig,
)
from flexorch.config.sharding import ShardingSettings, effective_shard_size  # noqa: E402
from flexorch.solver.model_state import model_state_bytes  # noqa: E402
from flexorch.solver.profiles import Profile  # noqa: E402

MB = 1e6
# byte lengths of the training documents (real text): each fits one worker's token budget, so every mode trains
# the same data-parallel plans and only the model-state layout differs
DOC_BYTES = [5, 40, 110, 17, 90, 100, 127, 60, 8, 33, 120, 71, 12, 101, 99, 3, 80, 45, 64, 22, 120, 7, 115, 55]


# ---------------------------------------------------------------------------------------------------------------
# Part 1: CPU workers under a cap
# ---------------------------------------------------------------------------------------------------------------


def ladder_model(dim: int, layers: int) -> ModelConfig:
    heads = dim // 32
    return ModelConfig(
        dim=dim,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 2),
        ffn_dim=(8 * dim // 3 + 3) // 4 * 4,
    )


def ladder(max_dim: int, max_layers: int) -> list[ModelConfig]:
    models = [ladder_model(d, n) for d in range(64, max_dim + 1, 64) for n in range(2, max_layers + 1)]
    return sorted(models, key=lambda m: (m.num_params(), m.dim))


def _split(mode: str) -> tuple[str, str]:
    """'fsdp-step' -> ('fsdp', 'step'): fsdp gathering each layer once per step ([sharding] gather = 'step')."""
    base, _, gather = mode.partition("-")
    return base, gather or "layer"


def mode_settings(mode: str, shard_size: int) -> ShardingSettings:
    base, gather = _split(mode)
    return ShardingSettings(
        mode=base, shard_size=shard_size if base == "hsdp" else None, precision="fp32", gather=gather
    )


def formula(model: ModelConfig, mode: str, workers: int, shard_size: int):
    base, gather = _split(mode)
    shards = effective_shard_size(base, workers, shard_size)
    return model_state_bytes(model.param_shapes(), shards, sharded=base != "replicate", param_bytes=4, gather=gather)


def largest_fitting(models: list[ModelConfig], mode: str, workers: int, shard_size: int, cap: float):
    """(largest model whose formula total fits the cap, the next larger candidate or None)."""
    fits = [m for m in models if formula(m, mode, workers, shard_size).total <= cap]
    if not fits:
        return None, models[0]
    best = max(fits, key=lambda m: m.num_params())
    larger = [m for m in models if m.num_params() > best.num_params()]
    return best, (min(larger, key=lambda m: m.num_params()) if larger else None)


def write_corpus(root: Path) -> Path:
    text = inspect.getsource(textwrap).encode()
    root.mkdir(parents=True, exist_ok=True)
    pos = 0
    for i, n in enumerate(DOC_BYTES):
        (root / f"doc_{i:03d}.txt").write_bytes(text[pos : pos + n])
        pos += n
    return root


def write_profile(path: Path, model: ModelConfig) -> Path:
    """A fixed CPU profile with the model's shape (no calibration: the planner gets the same inputs every run)."""
    return write_fixed_profile(path, model, "bench-memory-cpu", 11_000.0 * model.dim / 64 * model.num_layers / 2)


def model_label(m: ModelConfig) -> str:
    return f"L{m.num_layers} d{m.dim} ({m.num_params() / 1e6:.2f}M)"


class Runs:
    """Starts drivers for (model, mode) on a shared corpus; each under its own run directory."""

    def __init__(self, out: Path, workers: int, batch: int, shard_size: int, steps: int):
        from flexorch.data.corpus import load_corpus

        self.out, self.workers, self.batch, self.shard_size, self.steps = out, workers, batch, shard_size, steps
        corpus_dir = write_corpus(out / "corpus")
        self.data = CorpusConfig(source=str(corpus_dir), max_context=128)
        self.corpus = load_corpus(self.data)
        self.n = 0

    def start(self, model: ModelConfig, mode: str):
        from flexorch.control.driver import TrainingDriver

        self.n += 1
        run_dir = self.out / f"{self.n:02d}-{mode}-L{model.num_layers}-d{model.dim}"
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg = TrainConfig(
            steps=self.steps + 1,
            workers=self.workers,
            batch_size=self.batch,
            seed=0,
            run_dir=str(run_dir),
            model=model,
            optim=OptimConfig(lr=1e-3, warmup_steps=1),
            data=self.data,
            plan=PlanSettings(
                profile=str(write_profile(run_dir / "profile.json", model)), tokens_per_worker=128, time_limit_s=0.1
            ),
            sharding=mode_settings(mode, self.shard_size),
        )
        driver = TrainingDriver(cfg, corpus=self.corpus)
        driver.setup()
        return driver


def confirm_fit(runs: Runs, model: ModelConfig, mode: str, cap: float, steps: int) -> dict:
    """Train ``model`` under ``mode`` for a few steps; measured resident bytes (every rank) vs the formula."""
    t0 = time.perf_counter()
    driver = runs.start(model, mode)
    try:
        times = []
        for _ in range(steps):
            rec = driver.step().record
            times.append(rec["measured_ms"])
        measured = [int(b) for b in driver.workers.call("state_bytes")]
    finally:
        driver.shutdown()
    f = formula(model, mode, runs.workers, runs.shard_size)
    total = max(measured) + f.in_flight
    row = {
        "mode": mode,
        "model": model_label(model),
        "params": model.num_params(),
        "measured_resident": max(measured),
        "formula_resident": f.resident,
        "in_flight": f.in_flight,
        "measured_total": total,
        "fits": total <= cap,
        "step_ms": float(np.median(times[1:] if len(times) > 1 else times)),
    }
    print(
        f"  {mode:<9s} {row['model']:<22s} measured resident {row['measured_resident'] / MB:7.2f} MB (formula "
        f"{f.resident / MB:7.2f}) + in flight {f.in_flight / MB:6.2f} = {total / MB:7.2f} MB of {cap / MB:.0f}: "
        f"{'fits' if row['fits'] else 'OVER'}   ({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    return row


def compare_steps(runs: Runs, model: ModelConfig, modes: list[str], steps: int) -> dict[str, list[float]]:
    """All modes up at once, stepping in turn (rotating the order) on the same batches; step ms per mode."""
    drivers = {}
    try:
        for mode in modes:
            drivers[mode] = runs.start(model, mode)
        times: dict[str, list[float]] = {m: [] for m in modes}
        for i in range(steps):
            order = modes[i % len(modes) :] + modes[: i % len(modes)]
            for mode in order:
                rec = drivers[mode].step().record
                times[mode].append(rec["measured_ms"])
            print(
                f"  round {i + 1}/{steps}: " + "  ".join(f"{m} {times[m][-1]:7.1f} ms" for m in modes),
                flush=True,
            )
    finally:
        for d in drivers.values():
            d.shutdown()
    return {m: t[1:] for m, t in times.items()}  # the first step warms up (process groups, allocator)


def part1(args) -> dict:
    import ray

    modes = ["replicate", "fsdp", "fsdp-step", "hsdp"]
    start_local_ray(len(modes) * args.workers + 2)
    cap = args.cap_mb * MB
    models = ladder(args.max_dim, args.max_layers)
    print(
        f"Part 1: {args.workers} CPU workers, cap {args.cap_mb:.0f} MB of model state per worker; ladder of "
        f"{len(models)} decoders (width 64..{args.max_dim}, layers 2..{args.max_layers}); hsdp shard_size "
        f"{args.shard_size}; fp32"
    )
    print(f"{'mode':<9s} {'largest by formula':<22s} {'formula MB':>10s}   next candidate (formula MB)")
    picks = {}
    for mode in modes:
        best, nxt = largest_fitting(models, mode, args.workers, args.shard_size, cap)
        picks[mode] = best
        f = formula(best, mode, args.workers, args.shard_size) if best else None
        nf = formula(nxt, mode, args.workers, args.shard_size) if nxt else None
        print(
            f"{mode:<9s} {model_label(best) if best else 'none fits':<22s} "
            f"{(f.total / MB if f else float('nan')):10.2f}   "
            + (f"{model_label(nxt)} ({nf.total / MB:.2f})" if nxt else "(top of the ladder)"),
            flush=True,
        )
    runs = Runs(args.out, args.workers, args.batch, args.shard_size, max(args.steps, args.fit_steps))
    t0 = time.perf_counter()
    common = picks["replicate"]
    print(f"\nstep times at the common model {model_label(common)} (the largest replicate fits), rotating modes:")
    times = compare_steps(runs, common, modes, args.steps)
    print(f"  ({time.perf_counter() - t0:.0f} s)")
    print("\nconfirming the largest model per mode with real steps (resident bytes measured after AdamW steps):")
    fits = {}
    for mode in modes:
        if picks[mode] is not None:
            fits[mode] = confirm_fit(runs, picks[mode], mode, cap, args.fit_steps)
    ray.shutdown()
    return {"cap": cap, "picks": picks, "fits": fits, "times": times, "common": common}


def report_part1(r: dict) -> list[str]:
    fits, times = r["fits"], r["times"]
    base_params = fits["replicate"]["params"] if "replicate" in fits else None
    print(
        f"\n| mode | largest model | params | vs replicate | measured resident MB | formula resident MB | "
        f"in flight MB | total MB / cap {r['cap'] / MB:.0f} | fits |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for mode, row in fits.items():
        ratio = row["params"] / base_params if base_params else float("nan")
        print(
            f"| {mode} | {row['model']} | {row['params']:,} | {ratio:.2f}x | {row['measured_resident'] / MB:.2f} | "
            f"{row['formula_resident'] / MB:.2f} | {row['in_flight'] / MB:.2f} | {row['measured_total'] / MB:.2f} | "
            f"{'yes' if row['fits'] else 'NO'} |"
        )
    rep = float(np.median(times["replicate"]))
    print(f"\n| mode at {model_label(r['common'])} | median step ms | p-min ms | vs replicate | steps |")
    print("|---|---:|---:|---:|---:|")
    for mode, t in times.items():
        print(f"| {mode} | {np.median(t):.1f} | {min(t):.1f} | {np.median(t) / rep:.2f}x | {len(t)} |")
    verdicts = []
    if "fsdp" in fits and "replicate" in fits:
        ratio = fits["fsdp"]["params"] / base_params
        ok = ratio >= 3.5 and fits["fsdp"]["fits"] and fits["replicate"]["fits"]
        verdicts.append(
            f"target 1 (fsdp trains >= 3.5x replicate's parameters under the cap): {'met' if ok else 'NOT met'} "
            f"({fits['fsdp']['params']:,} vs {base_params:,} parameters = {ratio:.2f}x; measured totals "
            f"{fits['fsdp']['measured_total'] / MB:.1f} and {fits['replicate']['measured_total'] / MB:.1f} MB of "
            f"{r['cap'] / MB:.0f})"
        )
    fs = float(np.median(times["fsdp"])) / rep
    verdicts.append(
        f"target 2 (fsdp step time <= 1.3x replicate's at the same model): {'met' if fs <= 1.3 else 'NOT met'} "
        f"({np.median(times['fsdp']):.1f} vs {rep:.1f} ms = {fs:.2f}x; hsdp {np.median(times['hsdp']) / rep:.2f}x)"
    )
    if "fsdp-step" in times:
        fss = float(np.median(times["fsdp-step"])) / rep
        verdicts.append(
            f"  with [sharding] gather = 'step' (each layer gathered once per step, one reduce-scatter): "
            f"{'met' if fss <= 1.3 else 'NOT met'} ({np.median(times['fsdp-step']):.1f} ms = {fss:.2f}x)"
            + (
                f", largest model under the cap {fits['fsdp-step']['params'] / base_params:.2f}x replicate's"
                if "fsdp-step" in fits and base_params
                else ""
            )
        )
    return verdicts


# ---------------------------------------------------------------------------------------------------------------
# Part 2: FlexSP's setting, simulated
# ---------------------------------------------------------------------------------------------------------------

# the decoders behind FlexSP's GPT profiles (hidden, layers, heads from the profiles; SwiGLU width as LLaMA's)
GPT_FFN = {4096: 11008, 5120: 13824, 6656: 17920}


def gpt_model(profile: Profile, vocab: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        dim=profile.hidden,
        num_layers=profile.num_layers,
        num_heads=profile.num_heads,
        num_kv_heads=profile.num_kv_heads,
        ffn_dim=GPT_FFN.get(profile.hidden, (8 * profile.hidden // 3 + 255) // 256 * 256),
    )


def part2(args) -> tuple[list[dict], list[str]]:
    from flexorch.data.lengths import bundled_lengths_path, read_lengths
    from flexorch.data.stream import DocumentStream
    from flexorch.solver import Planner, PlannerConfig, baseline_times_ms
    from flexorch.solver.errors import InfeasibleBatchError
    from flexorch.solver.profiles import BUILTIN_PROFILES
    from flexorch.solver.validation import largest_degree

    n, context = 64, 384 * 1024
    names = [f"gpt-{s}-a100" for s in ("7b", "13b", "30b")]
    present = [nm for nm in names if nm in BUILTIN_PROFILES]
    missing = [nm for nm in names if nm not in BUILTIN_PROFILES]
    data = read_lengths(bundled_lengths_path())
    data = data[data > 0]
    print(
        f"\nPart 2: FlexSP's setting simulated: {', '.join(present)}"
        + (f" (no profile for {', '.join(missing)})" if missing else "")
        + f"; N={n}, context {context // 1024}K, batch {args.flexsp_batch}, {args.flexsp_steps} batch(es) per model, "
        f"planner {args.time_limit} s per batch; vocab {args.vocab}, fsdp over {n} in bf16"
    )
    rows = []
    for name in present:
        prof = BUILTIN_PROFILES[name]
        model = gpt_model(prof, args.vocab)
        state = model_state_bytes(model.param_shapes(), n, sharded=True, param_bytes=2)
        variants = {
            "profile (state 0, 28 GB acts)": prof,
            "executor state in 28 GB": dataclasses.replace(prof, model_state_bytes=state.total),
            "executor state in 40 GB": dataclasses.replace(
                prof, model_state_bytes=state.total, memory_budget_bytes=40e9
            ),
        }
        print(
            f"{name}: {model.num_params() / 1e9:.2f} B parameters; executor's figure per worker: resident "
            f"{state.resident / 1e9:.2f} GB + in flight {state.in_flight / 1e9:.2f} GB = {state.total / 1e9:.2f} GB"
        )
        # every variant plans the same batches: documents up to what the tightest variant's 64 devices hold
        caps = {label: largest_degree(n) * p.tokens_per_device for label, p in variants.items()}
        limit = min([context, *caps.values()])
        pool = data[data <= limit]
        if limit < context:
            print(
                f"  (the tightest variant's 64 devices hold {limit:,} tokens < {context:,}: every variant "
                f"plans batches of documents up to {limit // 1024}K here)"
            )
        for label, p in variants.items():
            stream = DocumentStream(pool.size, args.flexsp_batch, seed=0)
            pred, base, speed = [], [], []
            t0 = time.perf_counter()
            err = None
            with Planner(p, PlannerConfig(time_limit_s=args.time_limit)) as planner:
                for _ in range(args.flexsp_steps):
                    batch = pool[list(stream.next_batch().doc_ids)]
                    try:
                        r = planner.plan(batch, n)
                    except InfeasibleBatchError as e:
                        err = str(e)
                        break
                    b = baseline_times_ms(batch, n, p)
                    statics = {k: v for k, v in b.items() if k.startswith("static-") and v is not None}
                    best = min(statics, key=statics.get)
                    pred.append(r.predicted_ms)
                    base.append(statics[best])
                    speed.append(statics[best] / r.predicted_ms)
            row = {
                "model": name,
                "variant": label,
                "state_gb": p.model_state_bytes / 1e9,
                "tokens_per_device": p.tokens_per_device,
                "context": limit,
                "holds": caps[label],
                "pred_ms": float(np.mean(pred)) if pred else None,
                "static_ms": float(np.mean(base)) if base else None,
                "best_static": best if pred else None,
                "speedup": float(np.mean(speed)) if speed else None,
                "error": err,
            }
            rows.append(row)
            print(
                f"  {label:<30s} tokens/device {p.tokens_per_device:>6d}  64 devices hold {caps[label] // 1024:>3d}K  "
                + (
                    f"plan {row['pred_ms']:9.0f} ms  best static ({best}) {row['static_ms']:9.0f} ms  "
                    f"speedup {row['speedup']:.2f}x"
                    if pred
                    else f"infeasible: {err}"
                )
                + f"   ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    print(
        "\n| model | model state | state GB/device | tokens/device | 64 devices hold | context | plan ms "
        "| best static | static ms | speedup |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        if r["pred_ms"] is None:
            print(
                f"| {r['model']} | {r['variant']} | {r['state_gb']:.2f} | {r['tokens_per_device']} | "
                f"{r['holds'] // 1024}K | {r['context'] // 1024}K | infeasible | | | |"
            )
            continue
        print(
            f"| {r['model']} | {r['variant']} | {r['state_gb']:.2f} | {r['tokens_per_device']} | "
            f"{r['holds'] // 1024}K | {r['context'] // 1024}K | {r['pred_ms']:.0f} | {r['best_static']} | "
            f"{r['static_ms']:.0f} | "
            f"{r['speedup']:.2f}x |"
        )
    verdicts = []
    for name in present:
        mine = [r for r in rows if r["model"] == name]
        ref = mine[0]
        parts = []
        for r in mine[1:]:
            if r["speedup"] is None or ref["speedup"] is None:
                parts.append(f"{r['variant']}: infeasible")
                continue
            delta = r["speedup"] / ref["speedup"] - 1
            parts.append(
                f"{r['variant']}: {r['speedup']:.2f}x vs {ref['speedup']:.2f}x ({100 * delta:+.1f} %, same batches "
                f"up to {r['context'] // 1024}K)"
            )
        verdicts.append(
            f"{name} speedup over the best static layout, executor's state vs the profile's: " + "; ".join(parts)
        )
    return rows, verdicts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--cap-mb", type=float, default=64.0, help="model-state budget per worker, MB")
    ap.add_argument("--shard-size", type=int, default=2, help="hsdp: workers per shard group")
    ap.add_argument("--max-dim", type=int, default=768, help="widest decoder on the ladder")
    ap.add_argument("--max-layers", type=int, default=24, help="deepest decoder on the ladder")
    ap.add_argument("--batch", type=int, default=8, help="documents per global batch")
    ap.add_argument("--steps", type=int, default=6, help="steps per mode in the step-time comparison (first: warm-up)")
    ap.add_argument("--fit-steps", type=int, default=3, help="steps of each largest model to confirm its bytes")
    ap.add_argument("--vocab", type=int, default=50257, help="vocabulary of the GPT models of part 2")
    ap.add_argument("--flexsp-batch", type=int, default=512)
    ap.add_argument("--flexsp-steps", type=int, default=3, help="batches planned per GPT model and variant")
    ap.add_argument("--time-limit", type=float, default=0.5, help="planner budget per batch in part 2, seconds")
    ap.add_argument("--skip-cpu", action="store_true", help="part 2 only")
    ap.add_argument("--skip-flexsp", action="store_true", help="part 1 only")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_memory")
    ap.add_argument("--quick", action="store_true", help="4 steps, 2 fit steps, 1 batch per GPT model (same cap)")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.fit_steps, args.flexsp_steps = 4, 2, 1
    t0 = time.perf_counter()
    verdicts = []
    if not args.skip_cpu:
        verdicts += report_part1(part1(args))
    if not args.skip_flexsp:
        _, v = part2(args)
        verdicts += v
    print()
    for v in verdicts:
        print(v)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "measured/memory"))
