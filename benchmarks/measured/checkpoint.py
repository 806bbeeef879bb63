"""Checkpoints every step: step time with no saves, synchronous saves and asynchronous saves, to a local directory
and to S3 (moto's server on 127.0.0.1), replicated and fsdp, on a small model and one with over 100 MB of state.

One driver per (workers, model, sharding mode) trains the same stream throughout; its steps are split
into blocks, one block per way of saving, taken in turn (round robin, ``--rounds`` times), so the machine's noise
falls on every way alike. A block of ``--steps`` steps saves after each step (none: no save) through its own
checkpointer and store (``flexorch.control.checkpointer``; the driver's own periodic saves are off); a step's time
runs from its start to the start of the next, so it holds the step, the save's blocking part and, for an
asynchronous save, any wait for the one before it still in flight; the block's last save is waited for and
counted. Prints the median step time per way and its ratio to the steps without saves, and the state's size.

``--workers 1,2``: with 2 workers on this 2-core machine every core trains, so a background write takes CPU from the
steps; with 1 worker the other core is shared by the driver (planning the next step), Ray and the write.

``--in-process``: what a save costs a step when a core is free for the write, as a GPU node's host CPUs are while
its GPUs train: no Ray and no driver, one replicated model state (``workers.replicated_state``) trained on one
thread in this process, saving through its own ``write_state`` after every step (none, sync, async in turn, the same
blocks and rounds), to a local directory.

    python -m benchmarks.measured.checkpoint           # ~25 minutes on 2 cores
    python -m benchmarks.measured.checkpoint --quick   # one round, the small model only
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import run_main
from flexorch.config import CorpusConfig, ModelConfig, OptimConfig, PlanSettings, ShardingSettings, TrainConfig
from flexorch.control.checkpoint_store import CheckpointStore
from flexorch.control.checkpointer import Checkpointer
from flexorch.control.driver import TrainingDriver
from flexorch.control.run_checkpoints import RunCheckpoints
from flexorch.data.corpus import load_corpus

MODELS = {
    "small": ModelConfig(),
    "large": ModelConfig(dim=512, num_layers=4, num_heads=8, num_kv_heads=8, ffn_dim=1376),
}
"""The flexorch default (tiny) model, and one of 12.9 M parameters: 155 MB of parameters and AdamW moments."""
WAYS = ("none", "sync local", "async local", "sync s3", "async s3")


def _profile(path: Path, model: ModelConfig) -> Path:
    """A fixed cost-model profile of ``model``'s shape (no calibration: every block plans alike)."""
    from tests.train_helpers import model_profile

    path.write_text(model_profile(model, 11_000.0, memory_budget_bytes=4e9).to_json())
    return path


def _config(work: Path, corpus_dir: Path, model_name: str, mode: str, steps: int, workers: int) -> TrainConfig:
    model = MODELS[model_name]
    plan = PlanSettings(profile=str(_profile(work / f"{model_name}.json", model)), tokens_per_worker=256,
                        time_limit_s=0.2)  # fmt: skip
    return TrainConfig(
        steps=steps, workers=workers, batch_size=8, seed=0, run_dir=str(work / f"run-{workers}-{model_name}-{mode}"),
        model=model,
        optim=OptimConfig(lr=1e-4, warmup_steps=1), data=CorpusConfig(source=str(corpus_dir), max_context=256),
        plan=plan, sharding=ShardingSettings(mode=mode),
    )  # fmt: skip


def _checkpointer(driver: TrainingDriver, way: str, root: str) -> Checkpointer | None:
    if way == "none":
        return None
    kind, where = way.split()
    run = RunCheckpoints(CheckpointStore(f"{root}/{where}-{kind}"), driver.corpus, keep=1)
    return Checkpointer(run, driver._driver_state, lambda e: None, asynchronous=kind == "async")


def _measure(driver, ways: dict, steps: int, rounds: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each way's step times, and the times its ``save`` calls blocked the driver (staging, and any wait for the
    save before)."""
    times: dict[str, list[float]] = {w: [] for w in ways}
    blocked: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(rounds):
        for way, ck in ways.items():
            t = time.perf_counter()
            for _ in range(steps):
                driver.step()
                if ck is not None:
                    t_save = time.perf_counter()
                    ck.save(driver.step_no, driver.workers, wait=False)
                    blocked[way].append((time.perf_counter() - t_save) * 1e3)
                now = time.perf_counter()
                times[way].append((now - t) * 1e3)
                t = now
            if ck is not None:  # the block's last save, counted on its last step
                t0 = time.perf_counter()
                ck.wait()
                times[way][-1] += (time.perf_counter() - t0) * 1e3
            held = f" (save blocked {statistics.median(blocked[way][-steps:]):5.0f} ms)" if ck is not None else ""
            print(f"  round {r + 1}: {way:12s} {statistics.median(times[way][-steps:]):8.0f} ms/step{held}", flush=True)
    return times, blocked


def _run(cfg: TrainConfig, corpus, args, roots: dict) -> tuple[float, dict, dict]:
    """One driver: two warm-up steps (the first build and compile), then the blocks; (state MB, step times, times
    the saves blocked)."""
    driver = TrainingDriver(cfg, corpus=corpus)
    try:
        driver.setup()
        driver.step(), driver.step()
        ways = {w: _checkpointer(driver, w, roots.get(w.split()[-1], "")) for w in args.ways}
        times, blocked = _measure(driver, ways, args.steps, args.rounds)
        return _state_mb(next(ck for ck in ways.values() if ck is not None)), times, blocked
    finally:
        driver.shutdown()


def _state_mb(ck: Checkpointer) -> float:
    store = ck.checkpoints.store
    newest = store.checkpoints()[0]
    return sum(store.files(newest.name).values()) / 2**20


def _in_process(args) -> int:
    import torch

    from flexorch.testing.reference import pack_documents
    from flexorch.workers.attention.api import varlen_attn_func
    from flexorch.workers.model import loss_sum
    from flexorch.workers.model_state import StateSpec
    from flexorch.workers.replicated_state import ReplicatedState

    torch.set_num_threads(1)  # one core trains (a worker's own setting); the other is free for the write
    cfg = MODELS["large"]
    sharding = {"mode": "replicate", "shard_size": None, "precision": "fp32", "recompute": "none"}
    spec = StateSpec(0, cfg, OptimConfig(lr=1e-4, warmup_steps=1), 0, sharding, None)
    state = ReplicatedState(spec, world=lambda: None, guard=lambda f, *a: f(*a))
    gen = torch.Generator().manual_seed(0)
    b = pack_documents([torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (384, 256, 128)])
    attn = functools.partial(varlen_attn_func, cu_seqlens=b.cu_seqlens, max_seqlen=b.max_seqlen)

    def step() -> None:
        state.optimizer.zero_grad()
        loss_sum(state.model(b.tokens, b.position_ids, attn), b.labels).backward()
        state.optimizer.step()
        state.scheduler.step()

    root = Path(tempfile.mkdtemp(prefix="flexorch-ckpt-bench-"))
    ways = {"none": None, "sync local": False, "async local": True}
    times: dict[str, list[float]] = {w: [] for w in ways}
    step(), step()  # warm-up
    print(f"in process, large model, replicate, 1 training thread: {len(ways)} ways x {args.rounds} rounds x "
          f"{args.steps} steps")  # fmt: skip
    for r in range(args.rounds):
        for way, background in ways.items():
            t = time.perf_counter()
            for i in range(args.steps):
                step()
                if background is not None:
                    state.write_state(str(root / f"{way.split()[0]}-{i % 2}"), background)
                now = time.perf_counter()
                times[way].append((now - t) * 1e3)
                t = now
            if background:
                t0 = time.perf_counter()
                state.finish_upload()
                times[way][-1] += (time.perf_counter() - t0) * 1e3
            print(f"  round {r + 1}: {way:12s} {statistics.median(times[way][-args.steps :]):8.0f} ms/step", flush=True)
    med = {w: statistics.median(v) for w, v in times.items()}
    print("\nmedian ms per step with a checkpoint after every step; x: against the steps without saves")
    print(" ".join(f"{w:>18s}" for w in ways))
    print(" ".join(f"{med[w]:10.0f} ({med[w] / med['none']:4.2f}x)" for w in ways))
    shutil.rmtree(root, ignore_errors=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="blocks of each way, taken in turn (default 2)")
    ap.add_argument("--steps", type=int, default=2, help="steps per block (default 2)")
    ap.add_argument("--models", default="small,large", help="comma-separated: small, large (default both)")
    ap.add_argument("--modes", default="replicate,fsdp", help="comma-separated sharding modes (default both)")
    ap.add_argument("--workers", default="2,1", help="comma-separated worker counts (default 2,1)")
    ap.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of: {', '.join(WAYS)} (default all)")
    ap.add_argument("--quick", action="store_true", help="one round, the small model")
    ap.add_argument("--in-process", action="store_true", help="no Ray: one replicated state saving in this process")
    args = ap.parse_args(argv)
    if args.in_process:
        return _in_process(args)
    args.ways = tuple(w for w in WAYS if w in {x.strip() for x in args.ways.split(",")} or w == "none")
    if args.quick:
        args.rounds, args.models, args.workers = 1, "small", "2"
    import ray

    from tests.s3_server import s3_server
    from tests.train_helpers import write_corpus

    work = Path(tempfile.mkdtemp(prefix="flexorch-ckpt-bench-"))
    corpus_dir = write_corpus(work / "corpus")
    rows = []
    with s3_server() as s3:
        os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
        ray.init(address="local", num_cpus=3, include_dashboard=False, logging_level="ERROR",
                 runtime_env={"env_vars": s3.env})  # fmt: skip
        corpus = load_corpus(CorpusConfig(source=str(corpus_dir), max_context=256))
        try:
            for workers, model_name, mode in itertools.product(
                map(int, args.workers.split(",")), args.models.split(","), args.modes.split(",")
            ):
                cfg = _config(
                    work, corpus_dir, model_name, mode, 3 + len(args.ways) * args.steps * args.rounds, workers
                )
                print(f"{workers} workers, {model_name} model, {mode}: {len(args.ways)} ways x {args.rounds} rounds x "
                      f"{args.steps} steps")  # fmt: skip
                state, times, blocked = _run(cfg, corpus, args, roots={"s3": s3.root, "local": str(work / "ckpt")})
                med = {w: statistics.median(v) for w, v in times.items()}
                held = {w: statistics.median(v) for w, v in blocked.items() if v}
                rows.append((workers, model_name, mode, state, med, held))
        finally:
            ray.shutdown()
    print()
    print("median ms per step with a checkpoint after every step; x: against the steps without saves")
    head = f"{'workers':>7s} {'model':6s} {'mode':9s} {'state MB':>8s} " + " ".join(f"{w:>18s}" for w in args.ways)
    print(head)
    for workers, model_name, mode, state, med, _ in rows:
        cells = [f"{med['none']:10.0f}        "] + [
            f"{med[w]:10.0f} ({med[w] / med['none']:4.2f}x)" for w in args.ways[1:]
        ]
        print(f"{workers:7d} {model_name:6s} {mode:9s} {state:8.1f} " + " ".join(f"{c:>18s}" for c in cells))
    print()
    print("median ms a save blocked the driver (its staging, and any wait for the save before it)")
    print(f"{'workers':>7s} {'model':6s} {'mode':9s} " + " ".join(f"{w:>12s}" for w in args.ways[1:]))
    for workers, model_name, mode, _, _, held in rows:
        print(f"{workers:7d} {model_name:6s} {mode:9s} " + " ".join(f"{held[w]:12.0f}" for w in args.ways[1:]))
    (work / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"raw figures: {work / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "measured/checkpoint"))
