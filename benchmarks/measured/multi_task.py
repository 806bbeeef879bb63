"""Several tasks in one run, measured on real CPU workers: Spindle's per-step device allocation against running the
tasks in turn, on the same batches (issue 35; Spindle, arXiv 2409.03365).

Three ``[[tasks]]`` over one base model (frozen, LoRA adapters of ranks 4, 8 and 16), each with its own data:

- ``wiki``: text documents with the bundled Wikipedia lengths (FlexSP's release) divided by ``--scale``, filled with
  real text (the standard library's sources): the long-tailed task, whose longest documents need SP groups;
- ``code``: the standard library's own ``.py`` files (split at ``--max-context``): long documents;
- ``chat``: ``examples/data/chat_stdlib.jsonl`` (conversations about the standard library, loss on the answers).

Two runs train the same model on the same batches (same seed, same streams) with 4 worker actors each, and take
their steps in turn so machine noise hits them alike; only ``[plan] tasks`` differs: ``spindle`` (the tasks on
their own device blocks in waves) or ``in_turn`` (each task on every worker, one after another). Both compute the
same thing: the per-step losses are printed side by side (equal up to float reordering).

Prints per run: median step time (dispatch to last outcome), median compute time, the predictions (the simulator's,
with a barrier between micro-batches, and the barrier-free dataflow time the replicated workers run), and Spindle's
speedup; per step, both runs' wall times and losses.

    python -m benchmarks.measured.multi_task            # ~3 minutes on 2 cores
    python -m benchmarks.measured.multi_task --quick    # 3 steps
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sysconfig
import time
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT, run_main, start_local_ray  # noqa: E402
from benchmarks.measured.train import write_workload  # noqa: E402
from flexorch.config import CorpusConfig, ModelConfig, OptimConfig, PlanSettings, TrainConfig  # noqa: E402
from flexorch.config.tasks import TaskSettings  # noqa: E402
from flexorch.control.driver import TrainingDriver  # noqa: E402
from flexorch.data.task_corpus import load_task_corpus  # noqa: E402


def write_code(out: Path, n_files: int) -> None:
    """The first ``n_files`` of the standard library's top-level ``.py`` files, copied as documents."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out.mkdir(parents=True, exist_ok=True)
    for p in sorted(stdlib.glob("*.py"))[:n_files]:
        (out / p.name).write_bytes(p.read_bytes())


def tasks(data: dict[str, Path], max_context: int) -> tuple[TaskSettings, ...]:
    base = CorpusConfig(max_context=max_context, tokenizer="byte")
    spec = [("wiki", 0.5, 4, 1.0), ("code", 0.25, 8, 1.0), ("chat", 0.25, 16, 2.0)]
    return tuple(
        TaskSettings(
            name=name,
            data=dataclasses.replace(base, source=str(data[name])),
            share=share,
            weight=weight,
            lora_rank=rank,
            lora_targets=("wq", "wv", "w2"),
        )
        for name, share, rank, weight in spec
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32, help="documents per global batch (all tasks)")
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first is a warm-up)")
    ap.add_argument("--scale", type=float, default=4.0, help="divide Wikipedia lengths by this")
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--tokens-per-worker", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--time-limit", type=float, default=0.3, help="planner budget per step, seconds")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_multi_task")
    ap.add_argument("--quick", action="store_true", help="3 steps")
    args = ap.parse_args(argv)
    steps = 3 if args.quick else args.steps

    import ray

    start_local_ray(2 * args.workers + 2)
    data = {
        "wiki": args.out / "wiki",
        "code": args.out / "code",
        "chat": ROOT / "examples" / "data" / "chat_stdlib.jsonl",
    }
    write_workload(data["wiki"], args.batch * (steps + 2), args.scale, args.max_context, seed=1)
    write_code(data["code"], 40)
    base = TrainConfig(
        steps=steps,
        workers=args.workers,
        batch_size=args.batch,
        run_dir=str(args.out),
        model=ModelConfig(num_layers=args.layers, dim=args.dim, ffn_dim=344 * args.dim // 128, base_trainable=False),
        optim=OptimConfig(lr=1e-3, warmup_steps=1),
        data=CorpusConfig(max_context=args.max_context),
        plan=PlanSettings(tokens_per_worker=args.tokens_per_worker, time_limit_s=args.time_limit),
        tasks=tasks(data, args.max_context),
    )
    corpus = load_task_corpus(base.tasks)
    for name, st in corpus.stats["tasks"].items():
        lens = corpus.lengths[corpus.task_of == corpus.task_names.index(name)]
        print(
            f"task {name:<5s} {st['documents']:5d} documents, {int(lens.sum()):9,} tokens, "
            f"median {int(np.median(lens))}, longest {int(lens.max())}"
        )
    t0 = time.perf_counter()
    drivers = {}
    for method in ("spindle", "in_turn"):
        cfg = dataclasses.replace(
            base, run_dir=str(args.out / method), plan=dataclasses.replace(base.plan, tasks=method)
        )
        if drivers:  # calibrate once: the second run plans with the first one's profile
            profile = str(args.out / "spindle" / "profile.json")
            cfg = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, profile=profile))
        drivers[method] = TrainingDriver(cfg, corpus=corpus)
        drivers[method].setup()
    print(f"set up (calibration included) in {time.perf_counter() - t0:.0f} s")
    records: dict[str, list[dict]] = {m: [] for m in drivers}
    for i in range(steps):
        for method in list(drivers) if i % 2 == 0 else list(drivers)[::-1]:
            rec = drivers[method].step().record
            records[method].append(rec)
            print(f"  step {i + 1} {method:<8s} {rec['shape']:<34s} {rec['measured_ms']:8.1f} ms", flush=True)
    for d in drivers.values():
        d.shutdown()
    ray.shutdown()

    def med(method, key):
        return float(np.median([r[key] for r in records[method][1:]]))  # the first step warms up

    def dataflow(method):
        return float(
            np.median([(r.get("multitask") or {}).get("dataflow_ms", float("nan")) for r in records[method][1:]])
        )

    print()
    print(
        f"{'run':<9s} {'step ms':>9s} {'compute':>9s} {'pred (barrier)':>15s} {'pred (dataflow)':>16s} "
        f"{'vs in turn':>11s}"
    )
    turn = med("in_turn", "measured_ms")
    for m in drivers:
        print(
            f"{m:<9s} {med(m, 'measured_ms'):9.1f} {med(m, 'compute_ms'):9.1f} {med(m, 'predicted_ms'):15.1f} "
            f"{dataflow(m):16.1f} {turn / med(m, 'measured_ms'):10.2f}x"
        )
    print()
    print(
        f"{'step':>4s} {'spindle ms':>11s} {'in turn ms':>11s} {'ratio':>6s}  {'loss spindle':>12s} "
        f"{'loss in turn':>12s}"
    )
    worst = 0.0
    for a, b in zip(records["spindle"], records["in_turn"], strict=True):
        worst = max(worst, abs(a["loss"] - b["loss"]) / abs(b["loss"]))
        print(
            f"{a['step'] + 1:4d} {a['measured_ms']:11.1f} {b['measured_ms']:11.1f} "
            f"{b['measured_ms'] / a['measured_ms']:6.2f}  {a['loss']:12.6f} {b['loss']:12.6f}"
        )
    print(f"\nlosses: the two runs agree to {worst:.1e} relative (the same computation, placed differently)")
    out = {m: [{k: r[k] for k in ("step", "measured_ms", "compute_ms", "predicted_ms", "loss", "shape")} for r in rs]
           for m, rs in records.items()}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps({"records": out, "args": vars(args) | {"out": str(args.out)}}))
    print(f"wrote {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "measured/multi_task"))
