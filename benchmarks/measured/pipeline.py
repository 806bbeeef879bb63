"""Pipeline benchmark (not a test): elastic pipeline vs plain 1F1B vs Seq1F1B vs adaptive SP alone, side by side.

Part 1, paper scale, simulated with the reference constants (docs/design.md §2.1, profile gpt-13b-a100: 40 layers,
h=5120): 32 devices, contexts 48K and 96K, two length distributions: the shipped Wikipedia lengths and a
GitHub-like heavier tail (synthetic: lognormal, mu=8.5, sigma=1.9 tokens, seeded; InfiniPipe's CommonCrawl/GitHub
batches are long-tailed like this, we have no real file). A global batch is sequences drawn until 1M tokens,
longer ones truncated to the context. Per batch and strategy, the predicted step time (cost model + schedule
simulator):

* adaptive SP alone (FlexSP): ``solver.planner`` on all 32 devices;
* elastic pipeline (InfiniPipe-style): ``flexorch.solver.pipeline.plan.plan_pipeline`` (chunking granularity chosen per
  step, checkpointing ILP), best of P x d in {2x16, 4x8, 8x4} (P stages of d-way Ulysses SP);
* Seq1F1B: packed micro-batches (2P of them) each split into k=4 equal-work segments, same P x d choices;
* plain 1F1B: packed micro-batches (2P), no splitting, same P x d choices.

Part 2, measured on this CPU: 4 stage processes (gloo point-to-point), a 4-layer tiny model, long-tailed batches
of real Wikipedia lengths scaled to at most 2,048 tokens: step time (forward + backward) and the measured peak
activation bytes per stage for the three pipeline strategies, with their simulated bubble share.

    python -m benchmarks.measured.pipeline            # both parts (a few minutes)
    python -m benchmarks.measured.pipeline --quick    # one batch per setting
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from benchmarks.common import run_main  # noqa: E402
from flexorch.data.lengths import bundled_lengths_path, read_lengths  # noqa: E402
from flexorch.solver.pipeline.plan import packed_1f1b_units, plan_best_layout, plan_units, seq1f1b_units  # noqa: E402
from flexorch.solver.pipeline.stage_model import StageModel  # noqa: E402
from flexorch.solver.planner import PlannerConfig, plan_step  # noqa: E402
from flexorch.solver.profiles import get_profile  # noqa: E402

DEVICES = 32
LAYOUTS = [(2, 16), (4, 8), (8, 4)]


def _batches(data: np.ndarray, context: int, count: int, seed: int, tokens: int = 1_000_000) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        batch, total = [], 0
        while total < tokens:
            s = int(min(data[rng.integers(data.size)], context))
            batch.append(s)
            total += s
        out.append(batch)
    return out


def _best_pipeline(lengths, profile, units_fn):
    """The best P x d layout of a baseline; ``units_fn(lengths, p)`` gives its units for p stages."""
    best = None
    for p, d in LAYOUTS:
        model = StageModel(profile, p, d)
        try:
            plan = plan_units(model, units_fn(lengths, p), 0, time_limit_s=1.0)
        except ValueError:
            continue
        if best is None or plan.makespan_ms < best[0].makespan_ms:
            best = (plan, f"{p}x{d}")
    return best


def _picture(lengths, profile, best, seq, one) -> None:
    from pathlib import Path

    from flexorch.dashboards.pipeline_svg import render_pipelines_svg

    out = Path("runs/pipeline/schedules.svg")
    out.parent.mkdir(parents=True, exist_ok=True)
    panels = [
        (f"elastic pipeline {best[1]} ({len(lengths)} sequences)", best[0]),
        (f"Seq1F1B k=4 {seq[1]}", seq[0]),
        (f"plain 1F1B {one[1]}", one[0]),
    ]
    out.write_text(render_pipelines_svg(panels))
    print(f"  schedules of this batch: {out}", flush=True)


def part1(batches_per_setting: int) -> None:
    profile = get_profile("gpt-13b-a100")
    wiki = read_lengths(bundled_lengths_path())
    wiki = wiki[wiki > 0]
    github = np.maximum(np.random.default_rng(1).lognormal(8.5, 1.9, 200_000).astype(int), 1)
    a1, a2 = profile.a1_ms, profile.a2_ms
    print(f"Part 1: simulated, {profile.name}, {DEVICES} devices, global batch ~1M tokens, P x d in {LAYOUTS}")
    head = (
        f"{'data':<8} {'ctx':>4} {'batch':>5} {'SP alone s':>10} {'elastic PP s':>12} {'layout':>6} {'bubble':>6} "
        f"{'Seq1F1B s':>9} {'1F1B s':>8} {'x SP':>6} {'x Seq1F1B':>9} {'x 1F1B':>7} {'plan s':>6}"
    )
    print(head)
    ratios: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for name, data in (("wiki", wiki), ("github", github)):
        for context in (48 * 1024, 96 * 1024):
            for lengths in _batches(data, context, batches_per_setting, seed=10):
                sp = plan_step(lengths, DEVICES, profile, PlannerConfig(time_limit_s=2.0)).predicted_ms
                t0 = time.perf_counter()
                plan, p, d = plan_best_layout(lengths, DEVICES, profile, time_limit_s=1.0, layouts=LAYOUTS)
                best = (plan, f"{p}x{d}")
                plan_s = time.perf_counter() - t0
                seq = _best_pipeline(lengths, profile, lambda ls, p: seq1f1b_units(ls, 2 * p, 4, a1, a2))
                one = _best_pipeline(lengths, profile, lambda ls, p: packed_1f1b_units(ls, 2 * p, a1, a2))
                el = best[0].makespan_ms
                r = (sp / el, seq[0].makespan_ms / el, one[0].makespan_ms / el)
                ratios.setdefault((name, context), []).append(r)
                print(
                    f"{name:<8} {context // 1024:>3}K {len(lengths):>5} {sp / 1e3:>10.1f} {el / 1e3:>12.1f} "
                    f"{best[1]:>6} {best[0].bubble_share:>6.1%} {seq[0].makespan_ms / 1e3:>9.1f} "
                    f"{one[0].makespan_ms / 1e3:>8.1f} {r[0]:>5.2f}x {r[1]:>8.2f}x {r[2]:>6.2f}x {plan_s:>6.1f}",
                    flush=True,
                )
        if (
            name == "github" and context == 96 * 1024
        ):  # one picture: the last batch's schedules, elastic vs the baselines, shared time axis
            _picture(lengths, profile, best, seq, one)
    print("\nmedian speedup of the elastic pipeline:")
    for (name, context), rs in ratios.items():
        med = [statistics.median(x[j] for x in rs) for j in range(3)]
        print(
            f"  {name:<7} {context // 1024}K: vs SP alone {med[0]:.2f}x, vs Seq1F1B (k=4) {med[1]:.2f}x, "
            f"vs 1F1B {med[2]:.2f}x"
        )


# ---------------------------------------------------------------- part 2: measured on this CPU
CPU_LAYERS, CPU_STAGES = 4, 4


def _cpu_batches(count: int, seed: int) -> list[list[int]]:
    """Real Wikipedia lengths divided by 16 and capped at 2,048 tokens: a long-tailed CPU-sized batch of ~12K tokens."""
    data = read_lengths(bundled_lengths_path())
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        batch, total = [], 0
        while total < 12_000:
            s = int(min(max(data[rng.integers(data.size)] // 16, 2), 2048))
            batch.append(s)
            total += s
        out.append(batch)
    return out


def _calibrate(cfg) -> tuple[float, float, float]:
    """a1, a2, b1 (ms) of the whole tiny model, forward + backward on one process (least squares over lengths)."""
    import torch

    from flexorch.solver.pipeline.chunking import Piece
    from flexorch.testing.pipeline_local import build_stages
    from flexorch.workers.model import init_model
    from flexorch.workers.pipeline.stage import UnitInput

    model = init_model(cfg, seed=0)
    xs, ys = [], []
    for s in (128, 512, 1024, 2048, 2048, 512):
        seq = [torch.randint(0, cfg.vocab_size, (s,))]
        stage = build_stages(model, [cfg.num_layers])[0]
        t0 = time.perf_counter()
        stage.forward_unit(0, UnitInput([Piece(0, 0, s)], seq), None, s)
        stage.backward_unit(0, None)
        ys.append((time.perf_counter() - t0) * 1e3)
        xs.append([s * s, s, 1.0])
    a1, a2, b1 = np.linalg.lstsq(np.array(xs), np.array(ys), rcond=None)[0]
    return max(a1, 1e-9), max(a2, 1e-6), max(b1, 0.0)


def _cpu_job(ctx, strategy: str, batches, units_per_batch, cfg_dict, plans):
    """One strategy's steps on 4 ranks; returns per-step wall ms and this rank's peak held activation bytes."""
    import torch
    import torch.distributed as dist

    from flexorch.config import ModelConfig, OptimConfig
    from flexorch.workers.model import init_model
    from flexorch.workers.optim import build_optimizer

    torch.manual_seed(0)
    cfg = ModelConfig(**cfg_dict)
    model = init_model(cfg, seed=0)
    times, peak = [], 0
    with ctx.registry() as reg:
        if strategy == "SP alone":
            from flexorch.work.step import DocRef, step_work
            from flexorch.workers.step_context import StepContext
            from flexorch.workers.step_exec import run_step

            optim, sched = build_optimizer(model, OptimConfig())
            for lengths, plan in zip(batches, plans, strict=True):
                gen = torch.Generator().manual_seed(len(lengths))
                tokens = [torch.randint(0, cfg.vocab_size, (s,), generator=gen).numpy() for s in lengths]
                offs = np.cumsum([0] + lengths[:-1])
                blocks = {0: np.concatenate(tokens)}
                docs = [DocRef(i, 0, int(o), s) for i, (o, s) in enumerate(zip(offs, lengths, strict=True))]
                task = step_work(plan, docs, 0)[ctx.rank]
                reg.ensure(task.rank_sets)
                dist.barrier()
                t0 = time.perf_counter()
                step_ctx = StepContext(model, optim, sched, reg.group, reg.world, OptimConfig(), cfg.vocab_size)
                out = run_step(step_ctx, task, blocks)
                dist.barrier()
                times.append((time.perf_counter() - t0) * 1e3)
                peak = max(peak, out.peak_activation_bytes)
            return times, peak
        from flexorch.solver.pipeline.schedule import one_f_one_b
        from flexorch.solver.pipeline.stage_model import stage_layers
        from flexorch.testing.pipeline_local import build_stages
        from flexorch.work.pipeline import gradient_channels
        from flexorch.workers.pipeline.p2p import gradient_groups, run_stage_step

        r = ctx.rank
        reg.ensure(gradient_channels([(i,) for i in range(CPU_STAGES)]))  # gradients on a group per stage pair
        grad_groups = gradient_groups(reg.group, r, r - 1 if r > 0 else None, r + 1 if r < CPU_STAGES - 1 else None)
        stage = build_stages(model, stage_layers(cfg.num_layers, CPU_STAGES))[r]
        optim, sched = build_optimizer(stage, OptimConfig())
        for lengths, units in zip(batches, units_per_batch, strict=True):
            gen = torch.Generator().manual_seed(len(lengths))
            seqs = [torch.randint(0, cfg.vocab_size, (s,), generator=gen) for s in lengths]
            pipes = [(units, one_f_one_b(units, CPU_STAGES), [[0] * len(units)] * CPU_STAGES)]
            stage.reset_peak()
            optim.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            run_stage_step(stage, r, list(range(CPU_STAGES)), pipes, seqs, grad_groups=grad_groups)
            optim.step()
            sched.step()
            dist.barrier()
            times.append((time.perf_counter() - t0) * 1e3)
            peak = max(peak, stage.peak_held_bytes)
        return times, peak


def part2(steps: int) -> None:

    from flexorch.config import ModelConfig
    from flexorch.solver.pipeline.chunking import chunk_batch
    from flexorch.solver.planner import PlannerConfig, plan_step
    from flexorch.solver.step_planner import planner_profile
    from flexorch.workers.calibrate import activation_bytes_per_token
    from flexorch.workers.model import init_model
    from tests._dist_utils import DistPool

    cfg = ModelConfig(num_layers=CPU_LAYERS)
    a1, a2, b1 = _calibrate(cfg)
    profile = get_profile("gpt-7b-a100").with_overrides(
        name="tiny-cpu",
        a1_ms=a1,
        a2_ms=a2,
        b1_ms=b1,
        act_bytes_per_token=activation_bytes_per_token(init_model(cfg, 0), cfg.vocab_size),
        memory_budget_bytes=1e12,
        num_layers=cfg.num_layers,
        hidden=cfg.dim,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        bytes_per_element=4,
        a2a_gbps={2: 1.0, 4: 1.0},
        a2a_latency_ms={2: 4.0, 4: 8.0},
    )
    # SP alone: 4,096 tokens per device in any layout (in the measured bytes per token)
    profile = planner_profile(profile, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, tokens_per_worker=4096)
    batches = _cpu_batches(steps, seed=3)
    print(
        f"\nPart 2: measured, {CPU_STAGES} CPU processes (gloo), tiny model with {CPU_LAYERS} layers, "
        f"{steps} long-tailed batches of ~12K tokens (longest {max(max(b) for b in batches)}); calibrated "
        f"a1={a1:.3g} a2={a2:.3g} b1={b1:.3g} ms"
    )
    model = StageModel(profile.with_overrides(memory_budget_bytes=1e12), CPU_STAGES, 1)
    strategies = {
        "elastic PP": [
            min(
                (chunk_batch(b, k, a1, a2, 2048) for k in (4, 8, 16, 32)),
                key=lambda u: plan_units(model, u, 0).makespan_ms,
            )
            for b in batches
        ],
        "Seq1F1B k=4": [seq1f1b_units(b, 8, 4, a1, a2) for b in batches],
        "1F1B packed": [packed_1f1b_units(b, 8, a1, a2) for b in batches],
    }
    sp_plans = [plan_step(b, CPU_STAGES, profile, PlannerConfig(time_limit_s=1.0)).plan for b in batches]
    pool = DistPool(CPU_STAGES)
    rows = []
    try:
        order = list(strategies) + ["SP alone"]
        results = {name: ([], []) for name in order}
        for rnd in range(2):  # two rounds, alternating, so slow phases of a shared machine hit every strategy
            for name in order if rnd == 0 else reversed(order):
                units = strategies.get(name)
                res = pool.run(_cpu_job, name, batches, units, {"num_layers": CPU_LAYERS}, sp_plans, timeout_s=600)
                results[name][0].append([max(r[0][i] for r in res) for i in range(steps)])
                results[name][1].append(max(r[1] for r in res))
                print(f"  round {rnd + 1} {name}: median {statistics.median(results[name][0][-1]):.0f} ms", flush=True)
        for name in order:
            ms = statistics.median(t for run in results[name][0] for t in run[1:] or run)
            bubble = (
                statistics.median(plan_units(model, u, 0).bubble_share for u in strategies[name])
                if name in strategies
                else float("nan")
            )
            rows.append((name, ms, max(results[name][1]), bubble))
    finally:
        pool.close()
    base = next(r for r in rows if r[0] == "elastic PP")[1]
    print(f"{'strategy':<13} {'step ms':>8} {'vs elastic':>10} {'peak act MB':>11} {'sim. bubble':>11}")
    for name, ms, peak, bubble in rows:
        bub = "-" if bubble != bubble else f"{bubble:.1%}"
        print(f"{name:<13} {ms:>8.0f} {ms / base:>9.2f}x {peak / 1e6:>11.1f} {bub:>11}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one batch per setting")
    ap.add_argument("--part", choices=["1", "2", "both"], default="both")
    args = ap.parse_args(argv)
    if args.part in ("1", "both"):
        part1(1 if args.quick else 3)
    if args.part in ("2", "both"):
        part2(3 if args.quick else 6)


if __name__ == "__main__":
    raise SystemExit(run_main(main, "measured/pipeline"))
