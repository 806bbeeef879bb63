"""The control plane at scale (a benchmark, not a test): the driver's own time per step at 64, 256 and 1,024 fake
workers, with and without a worker lost mid-run.

Each run steps the real driver as the Ray actor runs it, ``DriverProcess`` (``TrainingDriver`` with what its
start built moved out of the garbage collector's passes: planner client, stream, membership, elastic recovery,
records, callbacks), without Ray, over the in-process fake worker group (``FakeWorkerGroup``, nodes of 8 workers: one
single-process reference step of the whole batch per step, on a tiny model) and ``LocalPlannerClient`` (the
adaptive planner's real solves, profile gpt-7b-a100). A batch holds 4 documents per worker (``plan_scale``'s 1,024
x 4,096) drawn from the bundled Wikipedia lengths divided by 16, at 512 tokens per worker: the plans of Wikipedia at
8,192 tokens per worker, for a sixteenth of the fake's compute (the driver's work depends on the documents and the
groups, not on their tokens). The lost-worker run kills one worker during step 3 (a ``Fault``): the elastic policy
shrinks the world and the batch runs again on the rest. The plans, and so the driver's work, change with the
planner's luck within its budget (``--budget``): compare rows of one run. Each run has a fresh process of its own
(spawned): objects frozen out of the collector are never freed, so an earlier run's would stay in the process and
weigh on the later runs' collections.

A step's wall time is cut into phases at the calls of the seams and of the driver's step methods:

- planner (excluded): ``plan`` and ``plan_ahead`` of the planner client. A plan asked ahead is solved at the next
  ``plan`` call, so no solve thread competes with the driver for the interpreter;
- workers (excluded): the fake group's ``run_step`` and ``settle`` (the reference step, the fake's bookkeeping);
- boundary: the step's start to its plan request (membership changes between steps, the next batch);
- plan: the driver's side of its plan requests (lengths, topology, the record's base fields);
- dispatch: the plan to the hand-over (documents located, every rank's work built, block specs);
- gather: the hand-over to the outcomes;
- records: the record built, checked and written, and the step callbacks;
- recovery: a failed settle to the next plan request (the elastic policy, the world formed again).

``own`` is their sum: the driver's time outside the planner's solve and the workers' compute; ``gc`` is the garbage
collector's pauses within it. ``pickle`` is what a Ray group's hand-over would add and the fake does not pay: the step's
work pickled once, as ``RayWorkerGroup.run_step``'s one ``ray.put`` does; ``per rank`` beside it is each rank's work
pickled apart, as one ``run_step.remote`` call per rank with its own work would (block specs left out of both: here they
are the blocks' tokens); a table gives their kilobytes and what a worker unpickles in each case (the whole step's work,
or its own). ``growth`` is ``own`` at N over ``own`` at the fewest workers, divided by the ratio of the workers: above 1
grows faster than linear. A row without a loss is the median over its steps after the first; a lost-worker row is its
step 3 (the attempt lost, the recovery, the re-run). ``--profile`` adds the largest run's cProfile (its functions by
cumulative time, the fake's and the planner's left out).

    python -m benchmarks.sim.control_plane              # 64, 256, 1,024 workers, 6 steps each (a few minutes)
    python -m benchmarks.sim.control_plane --quick      # 64 and 256 workers, 4 steps
    python -m benchmarks.sim.control_plane --profile    # also profile the 1,024-worker run
    python -m benchmarks.sim.control_plane --workers 1024 --profile   # just the largest size
"""

from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import dataclasses
import functools
import gc
import io
import multiprocessing
import os
import pickle
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from benchmarks.common import run_main  # noqa: E402
from flexorch.config import (  # noqa: E402
    CorpusConfig,
    ElasticSettings,
    ModelConfig,
    OptimConfig,
    PlanSettings,
    TrainConfig,
)
from flexorch.control.driver_process import DriverProcess  # noqa: E402
from flexorch.control.planner_client import LocalPlannerClient  # noqa: E402
from flexorch.data.lengths import bundled_lengths_path, read_lengths  # noqa: E402
from flexorch.solver.profiles import get_profile  # noqa: E402
from flexorch.solver.validation import largest_degree  # noqa: E402

try:  # the fake cluster lives with the testing helpers, or with the tests
    from flexorch.testing.fake_cluster import FakeWorkerGroup, Fault, memory_corpus  # noqa: E402
except ImportError:
    from tests.fake_cluster import FakeWorkerGroup, Fault, memory_corpus  # noqa: E402

PHASES = ("boundary", "plan", "dispatch", "gather", "records", "recovery")
"""The driver's own phases (their sum is ``own``); ``planner`` and ``workers`` are the excluded ones."""
HOOKS = {  # driver method -> (its phase, the phase after it returns; None: the one it interrupted)
    "_plan_attempt": ("plan", "dispatch"),
    "_plan_ahead": ("plan", None),
    "_trained_record": ("records", "records"),
    "_finish": ("records", "records"),
    "_skip": ("records", "records"),
    "_recover_attempt": ("recovery", "recovery"),
    "_roll_back": ("recovery", "recovery"),
}
DOCS_PER_WORKER = 4
LENGTH_SCALE = 16
TOKENS_PER_WORKER = 512
LOSS_STEP = 3
PER_NODE = 8
MODEL = ModelConfig(dim=16, num_layers=1, num_heads=2, num_kv_heads=1, ffn_dim=32)


class PhaseClock:
    """Wall time split into named phases: a call entering a phase interrupts the current one, which resumes (or
    another follows) when it returns."""

    def __init__(self):
        self.ms: dict[str, float] = defaultdict(float)
        self.extra: dict[str, float] = defaultdict(float)  # measured beside the phases (pickle)
        self.phase: str | None = None
        self.t = time.perf_counter()
        self.stack: list[str | None] = []

    def switch(self, phase: str | None) -> None:
        now = time.perf_counter()
        if self.phase is not None:
            self.ms[self.phase] += (now - self.t) * 1e3
        self.phase, self.t = phase, now

    def wrap(self, fn, phase: str, after=None):
        """``fn`` timed as ``phase``; when it returns the clock goes on in ``after(result)`` (a phase name, or a
        function of the result; None: the interrupted phase)."""

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.stack.append(self.phase)
            self.switch(phase)
            try:
                out = fn(*args, **kwargs)
            finally:
                back = self.stack.pop()
            nxt = after(out) if callable(after) else after
            self.switch(nxt or back)
            return out

        return timed

    def step(self, driver) -> tuple[dict, object]:
        """One ``driver.step()``: (ms per phase, the transition)."""
        self.ms.clear()
        self.extra.clear()
        self.stack.clear()
        self.switch("boundary")
        gc.callbacks.append(self._collected)
        try:
            transition = driver.step()
        finally:
            self.switch(None)
            gc.callbacks.remove(self._collected)
        return dict(self.ms), transition

    def _collected(self, what: str, info: dict) -> None:
        """The garbage collector's pauses in the driver's own phases (``gc``: a part of ``own``)."""
        if what == "start":
            self._gc_t = time.perf_counter()
        elif self.phase in PHASES:
            self.extra["gc"] += (time.perf_counter() - self._gc_t) * 1e3


class TimedPlanner:
    """The planner client with its calls timed as ``planner``; a plan asked ahead is solved when it is taken."""

    def __init__(self, inner, clock: PhaseClock):
        self.inner = inner
        self.plan = clock.wrap(inner.plan, "planner")
        self.plan_ahead = clock.wrap(lambda *a, **k: None, "planner")

    def __getattr__(self, name):
        return getattr(self.inner, name)


def instrument(driver, group, clock: PhaseClock) -> list[str]:
    """Time the fake group's calls as ``workers`` and the driver's step methods as their phases; the names of the
    hooks the driver lacks (their time is counted in the phase around them)."""
    group.run_step = clock.wrap(_pickling(group.run_step, clock), "workers", "gather")
    group.settle = clock.wrap(group.settle, "workers", lambda out: "gather" if out[1] is None else "recovery")
    missing = []
    for name, (phase, after) in HOOKS.items():
        if hasattr(type(driver), name):
            setattr(driver, name, clock.wrap(getattr(driver, name), phase, after))
        else:
            missing.append(name)
    if "_plan_attempt" in missing:  # the step's plan still ends the phases before the dispatch
        driver.planner.plan = clock.wrap(driver.planner.inner.plan, "planner", "dispatch")
    return missing


def _pickling(run_step, clock: PhaseClock):
    """``run_step`` after pickling the step's work as a Ray group hands it over (once for the step: ``pickle``) and
    as one call per rank would (``per rank``), timed apart, with their kilobytes and what a worker unpickles: the
    whole step's work (``loads``), or only its own (``rank_loads``, the largest rank's)."""

    def run(work, block_refs):
        t = time.perf_counter()
        one = pickle.dumps(list(work), protocol=5)
        clock.extra["pickle"] += (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        each = [pickle.dumps(w, protocol=5) for w in work]
        clock.extra["per_rank"] += (time.perf_counter() - t) * 1e3
        clock.extra["pickle_kb"] += len(one) / 1024
        clock.extra["per_rank_kb"] += sum(map(len, each)) / 1024
        clock.extra["loads"] += _loads_ms(one)
        clock.extra["rank_loads"] += _loads_ms(max(each, key=len))
        t = time.perf_counter()
        out = run_step(work, block_refs)
        clock.extra["fake"] += (time.perf_counter() - t) * 1e3
        return out

    return run


def _loads_ms(data: bytes) -> float:
    t = time.perf_counter()
    pickle.loads(data)
    return (time.perf_counter() - t) * 1e3


def sim_corpus(workers: int, steps: int, seed: int):
    """``steps`` batches of Wikipedia lengths / ``LENGTH_SCALE`` (those ``workers`` can hold), random tokens."""
    raw = read_lengths(bundled_lengths_path())
    lengths = np.maximum(2, raw[raw > 0] // LENGTH_SCALE)
    lengths = lengths[lengths <= largest_degree(workers) * TOKENS_PER_WORKER]
    rng = np.random.default_rng([seed, workers])
    drawn = rng.choice(lengths, steps * DOCS_PER_WORKER * workers)
    return memory_corpus([rng.integers(1, 257, int(n)) for n in drawn], vocab_size=257, block_docs=64)


def sim_config(workers: int, steps: int, run_dir: str, profile: str, max_context: int, args) -> TrainConfig:
    plan = PlanSettings(
        mode=args.mode, profile=profile, tokens_per_worker=TOKENS_PER_WORKER, time_limit_s=args.budget, timeout_s=600.0
    )
    return TrainConfig(
        steps=steps,
        workers=workers,
        batch_size=DOCS_PER_WORKER * workers,
        run_dir=run_dir,
        model=MODEL,
        optim=OptimConfig(lr=1e-3, warmup_steps=1),
        data=CorpusConfig(source="memory", max_context=max_context),
        plan=plan,
        elastic=ElasticSettings(wait_s=0.0),
    )


def sim_profile(path: str) -> str:
    """gpt-7b-a100 (FlexSP's A100 constants and shape: the planner prices groups as for a 7B model), its memory
    budget ``TOKENS_PER_WORKER`` tokens per worker."""
    p = get_profile("gpt-7b-a100")
    p = dataclasses.replace(p, name="control-plane-sim", memory_budget_bytes=p.act_bytes_per_token * TOKENS_PER_WORKER)
    with open(path, "w") as f:
        f.write(p.to_json())
    return path


def run(workers: int, steps: int, lose: bool, args, profiler=None) -> list[dict]:
    """One run: per step, ms per phase (+ ``own``, ``pickle``, ``fake``, the record's own timing fields)."""
    corpus = sim_corpus(workers, steps, args.seed)
    clock = PhaseClock()
    with tempfile.TemporaryDirectory(prefix="control_plane_") as tmp:
        profile = sim_profile(os.path.join(tmp, "profile.json"))
        cfg = sim_config(workers, steps, os.path.join(tmp, "run"), profile, int(corpus.lengths.max()), args)
        faults = [Fault(workers // 2, "step", LOSS_STEP)] if lose else []
        group = FakeWorkerGroup(cfg, None, faults, per_node=PER_NODE)
        planner = lambda spec, publish: TimedPlanner(LocalPlannerClient(spec, publish), clock)  # noqa: E731
        driver = DriverProcess(cfg, worker_group=group, planner=planner, corpus=corpus)
        driver.setup()
        missing = instrument(driver, group, clock)
        if missing:
            print(f"  (the driver has no {', '.join(missing)}: timed with the phase around them)", file=sys.stderr)
        rows = []
        try:
            while not driver.finished:
                if profiler is not None:
                    profiler.enable()
                ms, t = clock.step(driver)
                if profiler is not None:
                    profiler.disable()
                ms.update(clock.extra, own=sum(ms.get(p, 0.0) for p in PHASES), ran=t.ran.name)
                rec = t.record or {}
                ms.update({k: rec.get(k) for k in ("plan_wait_ms", "dispatch_ms", "overhead_ms", "boundary_ms")})
                ms["shape"] = rec.get("shape", "-")
                rows.append(ms)
                print(f"  {workers} workers{' (lost)' if lose else ''}: step {t.step} {ms['own']:.0f} ms own, "
                      f"{ms.get('workers', 0):.0f} ms workers, {ms.get('planner', 0):.0f} ms planner",
                      file=sys.stderr, flush=True)  # fmt: skip
        finally:
            driver.shutdown()
    return rows


def summary(rows: list[dict], lose: bool) -> dict:
    """The median of the steps after the first (no loss), or the loss step itself."""
    picked = [rows[LOSS_STEP]] if lose else rows[1:]
    keys = {k for r in picked for k, v in r.items() if isinstance(v, int | float)}
    return {k: statistics.median(r.get(k) or 0.0 for r in picked) for k in keys}


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}" if v < 100 else f"{v:,.0f}"


def print_tables(results: dict) -> None:
    print("\nDriver's own time per step, ms (planner's solve and workers' compute excluded; medians)\n")
    print(f"| workers | run | {' | '.join(PHASES)} | own | growth | pickle | own + pickle |")
    print("|---:|---|" + "---:|" * (len(PHASES) + 4))
    for (n, lose), s in results.items():
        base = results.get((min(k[0] for k in results), lose))
        growth = s["own"] / base["own"] / (n / min(k[0] for k in results)) if base else None
        cells = " | ".join(_fmt(s.get(p, 0.0)) for p in PHASES)
        print(f"| {n:,} | {'worker lost' if lose else 'no loss'} | {cells} | **{_fmt(s['own'])}** | "
              f"{growth:.2f} | {_fmt(s.get('pickle', 0.0))} | {_fmt(s['own'] + s.get('pickle', 0.0))} |")  # fmt: skip
    print("\nBeside it, ms: the excluded time and the record's own timing fields\n")
    print("| workers | run | gc in own | workers (fake) | planner | step wall | plan_wait_ms | dispatch_ms "
          "| overhead_ms | boundary_ms |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (n, lose), s in results.items():
        wall = s["own"] + s.get("workers", 0.0) + s.get("planner", 0.0)
        fields = " | ".join(_fmt(s.get(k)) for k in ("plan_wait_ms", "dispatch_ms", "overhead_ms", "boundary_ms"))
        print(f"| {n:,} | {'worker lost' if lose else 'no loss'} | {_fmt(s.get('gc', 0.0))} | "
              f"{_fmt(s.get('workers', 0.0))} | {_fmt(s.get('planner', 0.0))} | {_fmt(wall)} | {fields} |")  # fmt: skip
    print("\nThe hand-over a Ray group pays and the fake does not: the step's work pickled by the driver (ms, KB) and")
    print("unpickled by each worker (ms), once for the step (one put) or each rank's apart (per rank)\n")
    print("| workers | run | one put | KB | worker unpickles | per rank | KB | worker unpickles (largest) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    keys = ("pickle", "pickle_kb", "loads", "per_rank", "per_rank_kb", "rank_loads")
    for (n, lose), s in results.items():
        cells = " | ".join(_fmt(s.get(k, 0.0)) for k in keys)
        print(f"| {n:,} | {'worker lost' if lose else 'no loss'} | {cells} |")
    print("\nThe plans run (each step's shape in order: group size x groups per micro-batch)\n")
    print("| workers | run | shapes |")
    print("|---:|---|---|")
    for (n, lose), s in results.items():
        print(f"| {n:,} | {'worker lost' if lose else 'no loss'} | {' '.join(s['shapes'])} |")


def profile_text(profiler: cProfile.Profile, workers: int, steps: int, top: int) -> str:
    """The profiled run's functions by cumulative time per step (the fake's, the planner's and torch's left out)."""
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(r"flexorch/(control|records|work/|data|solver/step_planner)", top)
    lines = "\n".join(line for line in out.getvalue().splitlines() if "(" in line or "ncalls" in line)
    return (f"\ncProfile of the {workers:,}-worker run without a loss ({steps} steps, cumulative s over all steps; "
            f"under the profiler every call costs more)\n\n```\n{lines}\n```")  # fmt: skip


def case(workers: int, steps: int, lose: bool, args, profile: bool = False) -> tuple[list[dict], str | None]:
    """:func:`run` in this process: its rows, and with ``profile`` its cProfile's text."""
    profiler = cProfile.Profile() if profile else None
    rows = run(workers, steps, lose, args, profiler)
    return rows, profile_text(profiler, workers, steps, args.top) if profiler is not None else None


def fresh_case(workers: int, steps: int, lose: bool, args, profile: bool = False) -> tuple[list[dict], str | None]:
    """:func:`case` in a fresh process (spawned): what an earlier run froze out of the collector stays behind."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return pool.submit(case, workers, steps, lose, args, profile).result()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=float, default=1.0, help="planner time limit per solve (s): excluded anyway")
    ap.add_argument("--mode", default="adaptive", help="plan.mode: adaptive, or a static layout (static-ring-16)")
    ap.add_argument("--quick", action="store_true", help="64 and 256 workers, 4 steps")
    ap.add_argument("--profile", action="store_true", help="cProfile the largest run without a loss")
    ap.add_argument("--top", type=int, default=40, help="functions the profile lists")
    args = ap.parse_args(argv)
    sizes, steps = ([64, 256], 4) if args.quick else (sorted(args.workers), args.steps)
    if steps <= LOSS_STEP:
        ap.error(f"--steps must exceed {LOSS_STEP} (the lost-worker step)")
    print(f"\ncontrol_plane: the real driver (DriverProcess) on FakeWorkerGroup + LocalPlannerClient ({args.mode}, "
          f"{args.budget} s), Wikipedia lengths / {LENGTH_SCALE}, {DOCS_PER_WORKER} documents per worker, "
          f"{TOKENS_PER_WORKER} tokens per worker, {steps} steps, seed {args.seed}, {os.cpu_count()} CPUs")  # fmt: skip
    results = {}
    for n in sizes:
        for lose in (False, True):
            rows, _ = fresh_case(n, steps, lose, args)
            results[(n, lose)] = summary(rows, lose)
            results[(n, lose)]["shapes"] = [r["shape"] for r in rows]
    print_tables(results)
    if args.profile:  # a run of its own: the profiler slows every call it sees
        print(fresh_case(sizes[-1], steps, False, args, profile=True)[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "sim/control_plane"))
