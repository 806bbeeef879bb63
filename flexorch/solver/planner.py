"""The per-step planner: lengths + N devices + profile in, a frozen `Plan` out.

Per step (docs/design.md §2): candidate micro-batch splits (Sequence Blaster), ordered by their proven lower bound;
each candidate's micro-batches are planned by the bisection MILP (`solver.milp`), in parallel processes when
`workers > 1`; candidates whose bound cannot beat the best plan so far are skipped. A step never waits on the
solver: every MILP has a time limit, the step has a deadline, and the best static layout is always in hand as
the fallback.
"""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import numpy as np

from flexorch.solver.backend import DEFAULT_SOLVER, SOLVERS
from flexorch.solver.bounds import area_and_min_time, micro_batch_bound_ms, step_bound_ms
from flexorch.solver.cost_model import KINDS
from flexorch.solver.errors import InfeasibleBatchError
from flexorch.solver.microbatching import partition_candidates
from flexorch.solver.milp import best_static_draft, solve_micro_batch
from flexorch.solver.packing import group_types, improve_step, layout_groups, time_table, type_caps, type_overheads
from flexorch.solver.plan import MicroBatch, Plan
from flexorch.solver.profiles import Profile
from flexorch.solver.validation import check_batch

__all__ = ["PlannerConfig", "StepPlan", "Planner", "plan_step"]


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """Knobs of the per-step planner."""

    time_limit_s: float = 1.0
    """Wall-clock budget for one step's plan; past it the best plan so far is returned."""
    ilp_time_limit_s: float = 0.2
    """Time limit of one MILP solve (time-limited answers are used)."""
    max_buckets: int = 16
    """Length buckets per micro-batch in the MILP (optimal boundaries, FlexSP §4.1.3)."""
    tolerance: float = 0.01
    """Bisection stops when the makespan bracket is within this relative width."""
    max_bisection_steps: int = 8
    """At most this many MILP solves per micro-batch."""
    extra_micro_batches: int = 4
    """Blaster tries M_min .. M_min + this many micro-batches."""
    kinds: tuple[str, ...] = KINDS
    """Attention methods groups may use ('ulysses', 'ring')."""
    workers: int = 1
    """Processes solving micro-batches in parallel (1: in this process)."""
    solver: str = DEFAULT_SOLVER
    """MILP backend python-mip drives: 'highs' or 'cbc' (``solver.backend``)."""

    def __post_init__(self) -> None:
        if not self.time_limit_s > 0 or not self.ilp_time_limit_s > 0:
            raise ValueError("time limits must be > 0 seconds")
        if self.max_buckets < 1 or self.max_bisection_steps < 0 or self.extra_micro_batches < 0:
            raise ValueError("max_buckets >= 1, max_bisection_steps >= 0, extra_micro_batches >= 0 required")
        if not self.kinds or any(k not in KINDS for k in self.kinds):
            raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {self.kinds}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.solver not in SOLVERS:
            raise ValueError(f"solver must be one of {list(SOLVERS)}, got {self.solver!r}")


@dataclass(frozen=True)
class StepPlan:
    """A plan with how it was found: the inner :class:`Planner`'s answer, without the BatchAda floor. Callers
    outside the solver get a :class:`flexorch.solver.step_planner.PlannedStep` (the one solve result) from
    :class:`~flexorch.solver.step_planner.StepPlanner` instead."""

    plan: Plan
    predicted_ms: float
    """Predicted step time under the cost model (simulator, real lengths)."""
    bound_ms: float
    """Proven lower bound on any plan's step time for this batch (solver.bounds)."""
    solve_s: float
    status: str
    """'milp' (a MILP plan beat the static start), 'static' (none did), 'fallback' (time ran out first)."""
    details: dict = field(default_factory=dict)

    @property
    def gap(self) -> float:
        return self.predicted_ms / self.bound_ms - 1.0


class Planner:
    """Plans steps for one profile; holds the worker pool across steps when `workers > 1`."""

    def __init__(self, profile: Profile, config: PlannerConfig | None = None):
        self.profile = profile
        self.config = config or PlannerConfig()
        self._pool: ProcessPoolExecutor | None = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Planner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def plan(self, lengths, num_devices: int) -> StepPlan:
        t0 = time.perf_counter()
        cfg, prof = self.config, self.profile
        lengths = check_batch(lengths, num_devices, prof)
        n = int(num_devices)
        cap = prof.tokens_per_device  # per device, the most any group holds: for bounds and candidate splits
        types = group_types(n, prof, cfg.kinds)
        caps_t = type_caps(types, prof)  # tokens a group of each type holds
        table = time_table(lengths, types, prof)
        overheads = type_overheads(types, prof)  # b1 + collective latency per group type, once per micro-batch
        area, _ = area_and_min_time(table, types)
        if not np.isfinite(area).all():
            i = int(np.flatnonzero(~np.isfinite(area))[0])
            raise InfeasibleBatchError(
                f"sequence {i} ({lengths[i]} tokens) fits no group of kinds {cfg.kinds} on {n} devices (Ulysses "
                f"degrees must divide num_heads={prof.num_heads}); allow 'ring' or use more devices"
            )
        bound = step_bound_ms(table, types, lengths, n, cap, overheads)
        deg = np.array([t.degree for t in types], dtype=np.float64)
        deadline = t0 + cfg.time_limit_s

        cands = partition_candidates(lengths, area, n * cap, cfg.extra_micro_batches)
        mb_bounds = [[micro_batch_bound_ms(table[c], deg, n, overheads) for c in split] for split in cands]
        bounds = [sum(b) for b in mb_bounds]
        order = self._screen(cands, bounds, types, caps_t, overheads, table, lengths, n, t0 + 0.3 * cfg.time_limit_s)
        best_total, best_mbs, status, tried = np.inf, None, "fallback", 0
        for ci, starts in order:
            split = cands[ci]
            if bounds[ci] >= best_total:
                continue
            if best_mbs is not None and time.perf_counter() >= deadline:
                break
            sols = self._solve_split(
                split, mb_bounds[ci], types, caps_t, overheads, table, lengths, n, deadline, starts
            )
            tried += 1
            if sols is None:
                continue  # some micro-batch of this split cannot be packed
            drafts = [s[0] for s in sols]
            caps = [caps_t[np.asarray(d.group_type, dtype=np.int64)] for d in drafts]
            improve_step(drafts, caps, table, lengths, overheads)
            sols = [(d, d.makespan(), s[2]) for d, s in zip(drafts, sols, strict=True)]
            total = sum(s[1] for s in sols)
            if total < best_total:
                best_total, best_mbs = total, [(split, s) for split, s in zip(split, sols, strict=True)]
                status = "milp" if any(s[2] in ("milp", "exact") for s in sols) else "static"
        if best_mbs is None:  # no candidate split packs: halve micro-batches until each one does
            sols = self._split_until_packed(
                sorted(range(len(lengths)), key=lambda i: -lengths[i]), types, caps_t, overheads, table, lengths, n
            )
            best_total = sum(s[1] for s in sols)
            best_mbs, status = [(None, s) for s in sols], "fallback"
        mbs = [MicroBatch(tuple(layout_groups(draft, types, range(len(lengths))))) for _, (draft, *_rest) in best_mbs]
        plan = Plan.for_profile(
            num_devices=n,
            seq_lengths=lengths,
            micro_batches=mbs,
            profile=prof,
            meta={"planner": "flexorch-milp", "status": status},
        )
        solve_s = time.perf_counter() - t0
        details = {
            "candidates": len(cands),
            "candidates_solved": tried,
            "micro_batches": len(mbs),
            "methods": [s[2] for _, s in best_mbs],
        }
        return StepPlan(plan, float(best_total), bound, solve_s, status, details)

    def _screen(self, cands, bounds, types, caps_t, overheads, table, lengths, n, screen_deadline):
        """Order candidate splits by their best static layouts (what the MILP starts from), cheapest first.

        Bounds alone mislead: a micro-batch filled to the last per cent of memory packs only into a few huge groups,
        which no LP bound sees. Screening runs in bound order (memory-full splits last) until `screen_deadline`;
        splits it did not reach follow in that order.
        Returns [(candidate index, per-micro-batch static drafts or None)].
        """
        cap = self.profile.tokens_per_device
        # until screened, a split whose fullest micro-batch is within 10 % of memory is presumed costly
        fill = [max(int(lengths[c].sum()) for c in split) / (n * cap) for split in cands]
        key = [b * (1.0 + 10.0 * max(0.0, f - 0.9)) for b, f in zip(bounds, fill, strict=True)]
        done, rest = [], []
        for ci in np.argsort(key, kind="stable").tolist():
            if done and time.perf_counter() >= screen_deadline:
                rest.append((ci, None))
                continue
            starts = [
                best_static_draft(c, types, table, lengths, n, caps_t, overheads, polish=False) for c in cands[ci]
            ]
            est = np.inf if any(s is None for s in starts) else sum(s.makespan() for s in starts)
            done.append((est, ci, starts))
        done.sort(key=lambda x: x[0])
        return [(ci, starts) for _, ci, starts in done] + rest

    def _solve_split(self, split, lower_bounds, types, caps_t, overheads, table, lengths, n, deadline, starts=None):
        """[(draft, makespan_ms, method)] for each micro-batch of one split."""
        starts = starts or [None] * len(split)
        cfg = self.config
        args = list(zip(split, lower_bounds, strict=True))
        budget = max(0.0, deadline - time.perf_counter()) / max(1, len(split) if cfg.workers == 1 else 1)
        kw = dict(
            num_devices=n,
            caps_by_type=caps_t,
            overheads=overheads,
            max_buckets=cfg.max_buckets,
            tolerance=cfg.tolerance,
            max_bisection_steps=cfg.max_bisection_steps,
            ilp_time_limit_s=cfg.ilp_time_limit_s,
        )
        if cfg.workers > 1 and len(split) > 1:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(max_workers=cfg.workers)
            futs = [
                self._pool.submit(
                    solve_micro_batch,
                    items,
                    types,
                    table,
                    lengths,
                    lower_bound_ms=lb,
                    time_budget_s=budget,
                    start=st,
                    **kw,
                )
                for (items, lb), st in zip(args, starts, strict=True)
            ]
            out = []
            for (items, _), f in zip(args, futs, strict=True):
                try:
                    s = f.result(timeout=budget + 5.0)
                    got = None if s is None else (s.draft, s.makespan_ms, s.method)
                except FutureTimeout:
                    got = self._fallback(items, types, caps_t, overheads, table, lengths, n)
                if got is None:
                    return None
                out.append(got)
            return out
        out = []
        for (items, lb), st in zip(args, starts, strict=True):
            left = max(0.0, deadline - time.perf_counter())
            s = solve_micro_batch(
                items, types, table, lengths, lower_bound_ms=lb, time_budget_s=min(budget, left), start=st, **kw
            )
            if s is None:
                return None
            out.append((s.draft, s.makespan_ms, s.method))
        return out

    def _fallback(self, items, types, caps_t, overheads, table, lengths, n):
        d = best_static_draft(items, types, table, lengths, n, caps_t, overheads)
        return None if d is None else (d, d.makespan(), "fallback")

    def _split_until_packed(self, items, types, caps_t, overheads, table, lengths, n):
        """Always succeeds: one sequence alone fits the largest group (check_batch guarantees it)."""
        got = self._fallback(items, types, caps_t, overheads, table, lengths, n)
        if got is not None:
            return [got]
        half = len(items) // 2
        args = (types, caps_t, overheads, table, lengths, n)
        return self._split_until_packed(items[:half], *args) + self._split_until_packed(items[half:], *args)


def plan_step(lengths, num_devices: int, profile: Profile, config: PlannerConfig | None = None) -> StepPlan:
    """Plan one step (a convenience wrapper around `Planner`)."""
    with Planner(profile, config) as planner:
        return planner.plan(lengths, num_devices)
