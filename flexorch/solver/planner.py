"""The per-step planner: lengths + N devices + profile in, a frozen `Plan` out.

Per step (docs/design.md §2): candidate micro-batch splits (Sequence Blaster, FlexSP arXiv 2412.01523 §4.2),
ordered by their best static layouts; each candidate's micro-batches are planned by the bisection MILP
(`solver.milp`); candidates whose bound cannot beat the best plan so far are skipped.

``time_limit_s`` is a wall-clock promise for :meth:`Planner.plan`, all of it: the solver limits are set from the time
left, the loops (candidate splits, screening, local search, baselines) check the clock, and optional work is cut
when time is short, so a busy machine gets a worse plan on time rather than a late one. The best static layout of
every micro-batch is in hand before any MILP starts and is the answer for a solve that does not come back.

The MILP solves run in a solver process the Planner owns (``isolate``, the default; ``solver.solver_process``:
started with the Planner, from a ``forkserver`` that has imported the solver once, so a restart costs milliseconds):
a native crash of the MILP library (SIGSEGV / SIGABRT, coin-or/Cbc#693) costs that solve, not the plan. The planner
keeps the static start of that micro-batch, restarts the process, retries while time is left and counts the crash;
a solve still running at the deadline is killed the same way. With ``isolate=False`` the solves run in this process
(in a thread the planner stops waiting for at the deadline; tests and benchmarks).
"""

from __future__ import annotations

import copy
import functools
import math
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

import numpy as np

from flexorch.solver.backend import DEFAULT_SOLVER, SOLVERS
from flexorch.solver.bounds import area_and_min_time, micro_batch_bound_ms, step_bound_ms
from flexorch.solver.cost_model import KINDS
from flexorch.solver.errors import InfeasibleBatchError
from flexorch.solver.fill import fill_draft
from flexorch.solver.microbatching import partition_candidates
from flexorch.solver.packing import (
    Draft,
    best_homogeneous_draft,
    drop_empty,
    group_types,
    improve_step,
    layout_groups,
    time_table,
    type_caps,
    type_overheads,
)
from flexorch.solver.plan import MicroBatch, Plan
from flexorch.solver.profiles import Profile
from flexorch.solver.round_bounds import best_round_split, slowest_fronts
from flexorch.solver.solver_process import SolverPool
from flexorch.solver.validation import check_batch, check_num_devices

__all__ = ["PlannerConfig", "StepPlan", "Planner", "plan_step"]

MIN_SOLVE_S = 0.02
"""A MILP solve is not started with less time than this left: the static start is the answer then."""


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """Knobs of the per-step planner."""

    time_limit_s: float = 1.0
    """Wall-clock budget for one step's plan, everything included; past it the best plan so far is returned."""
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
    """Solver processes: the micro-batches of a split are solved this many at a time (``isolate`` only)."""
    solver: str = DEFAULT_SOLVER
    """MILP backend python-mip drives: 'highs' or 'cbc' (``solver.backend``)."""
    fill_starts: bool = True
    """Start each micro-batch from the better of its best homogeneous layout and a mixed layout packed in
    milliseconds (``solver.fill``), and order the candidate splits by those (False: homogeneous starts only, as
    before issue 22; for the planner-quality benchmark)."""
    tiered_splits: bool = True
    """Offer tiered micro-batch splits too (``solver.microbatching.tiered_split``: sequences far slower than an
    average micro-batch share one)."""
    round_splits: bool = True
    """With ``tiered_splits``: tiered splits that start from the slowest sequences' best micro-batches, as the rounds
    bound places them (``solver.round_bounds.best_round_split``: chains of them in one group where memory allows)."""
    isolate: bool = True
    """Solve the MILPs in solver processes the Planner owns (a native crash or a stuck solve costs that solve, not
    the plan). False: in this process (no extra process; a crash of the MILP library takes the caller down)."""

    def __post_init__(self) -> None:
        if not self.time_limit_s > 0 or not self.ilp_time_limit_s > 0:
            raise ValueError("time limits must be > 0 seconds")
        if self.max_buckets < 1 or self.max_bisection_steps < 0 or self.extra_micro_batches < 0:
            raise ValueError("max_buckets >= 1, max_bisection_steps >= 0, extra_micro_batches >= 0 required")
        if not self.kinds or any(k not in KINDS for k in self.kinds):
            raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {self.kinds}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.workers > 1 and not self.isolate:
            raise ValueError(
                f"workers={self.workers} solver processes need isolate=True (in-process solves run one at a time)"
            )
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
    """'milp' (a MILP plan beat the start), 'static' (none did: the start, homogeneous or ``solver.fill``'s mixed
    layout, stands), 'fallback' (time ran out before any candidate split was solved or packed by ``solver.fill``:
    homogeneous starts, solves cut at the deadline)."""
    details: dict = field(default_factory=dict)
    """How the time went: 'time_limit_s', 'used_s', 'solver_crashes' (solver processes that died in this plan),
    'solves_cut' (solves stopped at the deadline), candidates, methods per micro-batch."""

    @property
    def gap(self) -> float:
        return self.predicted_ms / self.bound_ms - 1.0

    @property
    def solver_crashes(self) -> int:
        return int(self.details.get("solver_crashes", 0))


# ---- the planner


class Planner:
    """Plans steps for one profile; owns the solver process(es) across steps (``config.isolate``)."""

    def __init__(self, profile: Profile, config: PlannerConfig | None = None):
        self.profile = profile
        self.config = config or PlannerConfig()
        self._solver = SolverPool(self.config.workers, self.config.isolate, self.config.solver)
        self._inject_crashes = 0
        self._idle = None
        self._finish_s: float | None = None  # measured: building the plan after the last solve (for the reserve)
        self._polish_s: float | None = None  # measured: the local search over a solved split (for the reserve)
        self.crashes_total = 0
        self._filled: set[int] = set()
        self._bound = None  # the step's bound, or the call that computes it (``_step_bound``)

    def inject_crashes(self, crashes: int = 1) -> None:
        """Test seam: the solver process of each of the next ``crashes`` solves kills itself with SIGSEGV, as a
        native crash of the MILP library does (``isolate`` only: in-process it would take the caller down)."""
        if crashes and not self.config.isolate:
            raise ValueError("crash injection needs PlannerConfig(isolate=True): in-process it kills the caller")
        self._inject_crashes = int(crashes)

    def close(self) -> None:
        self._solver.close()

    def __enter__(self) -> Planner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def plan(self, lengths, num_devices: int, deadline: float | None = None, idle=None) -> StepPlan:
        """Plan one step by ``deadline`` (a ``time.monotonic()`` value; default: ``time_limit_s`` from now).

        ``idle(until, stop)``: work of the caller's to do here while MILP solves run in the solver process (the
        baselines), until ``until`` or until ``stop()`` says the solves are back."""
        self._idle = idle
        try:
            return self._plan(lengths, num_devices, deadline)
        finally:
            self._idle = None

    def _plan(self, lengths, num_devices: int, deadline: float | None) -> StepPlan:
        t0 = time.monotonic()
        deadline = t0 + self.config.time_limit_s if deadline is None else deadline
        given = deadline - t0
        deadline -= 0.003 + 0.01 * max(0.0, given)  # a margin for the clock reads between the checks
        cfg, prof = self.config, self.profile
        check_num_devices(num_devices)
        lengths = check_batch(lengths, num_devices, prof)
        n = int(num_devices)
        cap = prof.tokens_per_device  # per device, the most any group holds: for bounds and candidate splits
        types = group_types(n, prof, cfg.kinds)
        caps_t = type_caps(types, prof)  # tokens a group of each type holds
        table = time_table(lengths, types, prof)
        overheads = type_overheads(types, prof)  # b1 + collective latency per group type, once per micro-batch
        area, wall = area_and_min_time(table, types)
        if not np.isfinite(area).all():
            i = int(np.flatnonzero(~np.isfinite(area))[0])
            raise InfeasibleBatchError(
                f"sequence {i} ({lengths[i]} tokens) fits no group of kinds {cfg.kinds} on {n} devices (Ulysses "
                f"degrees must divide num_heads={prof.num_heads}); allow 'ring' or use more devices"
            )
        deg = np.array([t.degree for t in types], dtype=np.float64)
        slowest = slowest_fronts(table, deg, lengths, n, cap)  # the slowest sequences' rounds: bound and splits
        # the step's bound is reported, not used to plan: computed while the first MILPs run (or at the end)
        self._bound = functools.partial(step_bound_ms, table, types, lengths, n, cap, overheads, slowest=slowest)
        # the plan is built after the last solve: keep what that took last time (x1.5), at most a third of the time
        # after the last solve come the local search over the split and building the plan: keep what they took last
        # time (x1.5), at most a third of the time
        finish = self._finish_s if self._finish_s is not None else 0.005 + 4e-6 * lengths.size
        polish = self._polish_s if self._polish_s is not None else 0.01 + 1e-5 * lengths.size
        budget = max(0.0, deadline - t0)
        polish_deadline = deadline - min(1.5 * finish + 0.005, 0.15 * budget)
        solve_deadline = deadline - min(1.5 * (finish + polish) + 0.005, 0.3 * budget)
        screen_deadline = t0 + 0.3 * max(0.0, solve_deadline - t0)
        run = {"crashes": 0, "cut": 0}

        tiers = None
        if cfg.tiered_splits:  # the least degree that holds each sequence: a tier's sequences run side by side
            cheapest = np.argmin(table * deg[None, :], axis=1)  # each sequence's least-device-time type
            rows = np.arange(len(lengths))
            own = (deg[cheapest].astype(np.int64), table[rows, cheapest])
            rounds = best_round_split(*slowest) if cfg.round_splits else None  # their best micro-batches: a start
            tiers = (wall, deg[np.argmax(np.isfinite(table), axis=1)].astype(np.int64), n, own, rounds)
        kinds: list[str] = []
        cands = partition_candidates(
            lengths, area, n * cap, cfg.extra_micro_batches, deadline=screen_deadline, tiers=tiers, kinds=kinds
        )
        mb_bounds = [[micro_batch_bound_ms(table[c], deg, n, overheads) for c in split] for split in cands]
        bounds = [sum(b) for b in mb_bounds]
        fill_deadline = t0 + 0.6 * max(0.0, solve_deadline - t0)
        self._filled = set()  # candidate splits whose every micro-batch solver.fill packed (in _screen)
        order = self._screen(
            cands, kinds, bounds, mb_bounds, types, caps_t, overheads, table, lengths, n, screen_deadline, fill_deadline
        )
        best_total, best_mbs, finished, tried = np.inf, None, False, 0
        best_pre = None  # (candidate, its micro-batches' solutions before the local search) of the best split
        for ci, starts in order:
            split = cands[ci]
            if bounds[ci] >= best_total:
                continue
            if best_mbs is not None and time.monotonic() + MIN_SOLVE_S >= solve_deadline:
                break
            if starts is None:  # not screened: its static starts now (each micro-batch's best homogeneous layout)
                starts = [
                    best_homogeneous_draft(c, types, table, lengths, n, caps_t, overheads, deadline=solve_deadline)
                    for c in split
                ]
            sols, complete = self._solve_split(
                split,
                mb_bounds[ci],
                types,
                caps_t,
                overheads,
                table,
                lengths,
                n,
                solve_deadline,
                starts,
                run,
                wait_until=polish_deadline,
            )
            tried += 1
            if sols is None:
                continue  # some micro-batch of this split cannot be packed
            finished |= complete or ci in self._filled  # a split packed by solver.fill is planned, MILPs cut or not
            pre = [(copy.deepcopy(d), m) for d, m in sols]  # before the local search (it changes drafts in place)
            p0 = time.monotonic()
            total, kept = _polish(sols, caps_t, table, lengths, overheads, polish_deadline)
            took = time.monotonic() - p0
            self._polish_s = took if self._polish_s is None else max(took, 0.5 * (self._polish_s + took))
            if total < best_total:
                best_total, best_mbs, best_pre = total, kept, (ci, pre)
        if cfg.fill_starts and best_pre is not None and time.monotonic() + 2 * MIN_SOLVE_S < solve_deadline:
            # time left: the best split's MILPs again from the homogeneous starts (the bisection is not monotone in
            # its start), each micro-batch keeping the better of the two
            got = self._second_pass(
                *best_pre,
                cands,
                mb_bounds,
                types,
                caps_t,
                overheads,
                table,
                lengths,
                n,
                solve_deadline,
                run,
                polish_deadline,
            )
            if got is not None and got[0] < best_total:
                best_total, best_mbs = got
        t_finish = time.monotonic()
        if best_mbs is None:  # no candidate split packs: halve micro-batches until each one does
            drafts = self._split_until_packed(
                sorted(range(len(lengths)), key=lambda i: -lengths[i]), types, caps_t, overheads, table, lengths, n
            )
            caps = [caps_t[np.asarray(d.group_type, dtype=np.int64)] for d in drafts]
            improve_step(drafts, caps, table, lengths, overheads, deadline=polish_deadline)
            drafts = drop_empty(drafts)
            best_total, best_mbs = sum(d.makespan() for d in drafts), [(d, "fallback") for d in drafts]
        if not finished:
            status = "fallback"
        else:
            status = "milp" if any(m in ("milp", "exact") for _, m in best_mbs) else "static"
        mbs = [MicroBatch(tuple(layout_groups(draft, types, range(len(lengths))))) for draft, _ in best_mbs]
        plan = Plan.for_profile(
            num_devices=n,
            seq_lengths=lengths,
            micro_batches=mbs,
            profile=prof,
            meta={"planner": "flexorch-milp", "status": status},
        )
        bound = self._step_bound()  # computed already if a MILP ran in the solver process; else now (in `finish`)
        done = time.monotonic()
        took = done - t_finish
        self._finish_s = took if self._finish_s is None else max(took, 0.5 * (self._finish_s + took))
        self.crashes_total += run["crashes"]
        details = {
            "candidates": len(cands),
            "candidates_solved": tried,
            "micro_batches": len(mbs),
            "methods": [m for _, m in best_mbs],
            "time_limit_s": round(given, 4),
            "used_s": round(done - t0, 4),
            "solver_crashes": run["crashes"],
            "solves_cut": run["cut"],
            "isolated": self._solver.isolate,
        }
        return StepPlan(plan, float(best_total), bound, done - t0, status, details)

    def _step_bound(self) -> float:
        """The step's lower bound (``solver.bounds.step_bound_ms``), computed once per plan, on first call."""
        if callable(self._bound):
            self._bound = float(self._bound())
        return self._bound

    def _second_pass(
        self, ci, pre, cands, mb_bounds, types, caps_t, overheads, table, lengths, n, deadline, run, polish_deadline
    ):
        """(step time, [(draft, method)]) of split `ci` solved again from homogeneous starts, each micro-batch the
        better of that and `pre` (the first pass), after the local search; None when nothing got better."""
        split = cands[ci]
        starts = [
            best_homogeneous_draft(c, types, table, lengths, n, caps_t, overheads, deadline=deadline) for c in split
        ]
        if any(s is None for s in starts):
            return None
        sols, _ = self._solve_split(
            split,
            mb_bounds[ci],
            types,
            caps_t,
            overheads,
            table,
            lengths,
            n,
            deadline,
            starts,
            run,
            wait_until=polish_deadline,
        )
        if sols is None:
            return None
        merged = [b if b[0].makespan() < a[0].makespan() else a for a, b in zip(pre, sols, strict=True)]
        if all(m is a for m, a in zip(merged, pre, strict=True)):
            return None
        return _polish([(copy.deepcopy(d), m) for d, m in merged], caps_t, table, lengths, overheads, polish_deadline)

    def _screen(
        self,
        cands,
        kinds,
        bounds,
        mb_bounds,
        types,
        caps_t,
        overheads,
        table,
        lengths,
        n,
        screen_deadline,
        fill_deadline,
    ):
        """Order candidate splits by their static starts (what the MILP starts from), cheapest first.

        Bounds alone mislead: a micro-batch filled to the last per cent of memory packs only into a few huge groups,
        which no LP bound sees, and the sorted split's micro-batches of equal long sequences leave no devices for
        the next-longest. Screening takes the lowest-bound split of each strategy (`kinds`) first, then the rest, in
        bound order (memory-full splits last), until `screen_deadline`
        (`fill_deadline` with ``fill_starts``); splits it did not reach follow in that order, and a split whose bound
        cannot beat a screened split's start is not screened. Each micro-batch's start is its best homogeneous
        layout, or with ``fill_starts`` (until `fill_deadline`) the better of that and its mixed layout from
        ``solver.fill``.
        Returns [(candidate index, per-micro-batch static drafts or None)].
        """
        cap = self.profile.tokens_per_device
        # until screened, a split whose fullest micro-batch is within 10 % of memory is presumed costly
        fill = [max(int(lengths[c].sum()) for c in split) / (n * cap) for split in cands]
        key = [b * (1.0 + 10.0 * max(0.0, f - 0.9)) for b, f in zip(bounds, fill, strict=True)]
        until = fill_deadline if self.config.fill_starts else screen_deadline
        done, rest = [], []
        best_est = np.inf
        by_key = np.argsort(key, kind="stable").tolist()
        first_of_kind: dict[str, int] = {}
        for ci in by_key:
            first_of_kind.setdefault(kinds[ci], ci)
        # tiered splits exist only where some sequences are far slower than a micro-batch's share: then they are
        # the informed ones (code256 at 1 s: the sorted split, lowest bound, took the time of the better tiered one)
        informed = [ci for kind, ci in first_of_kind.items() if kind.startswith(("tiered", "rounds"))]
        firsts = set(first_of_kind.values())
        lead = sorted(informed, key=by_key.index) + [ci for ci in by_key if ci in firsts and ci not in informed]
        for ci in lead + [ci for ci in by_key if ci not in firsts]:
            if bounds[ci] >= best_est:  # cannot beat a split already screened: the solve loop skips it too
                rest.append((ci, None))
                continue
            if done and time.monotonic() >= until:
                rest.append((ci, None))
                continue
            starts = [best_homogeneous_draft(c, types, table, lengths, n, caps_t, overheads) for c in cands[ci]]
            if self.config.fill_starts and time.monotonic() < fill_deadline:
                starts, whole = self._fill_starts(
                    cands[ci], mb_bounds[ci], starts, types, caps_t, overheads, table, lengths, n, fill_deadline
                )
                if whole:
                    self._filled.add(ci)
            est = np.inf if any(s is None for s in starts) else sum(s.makespan() for s in starts)
            best_est = min(best_est, est)
            done.append((est, ci, starts))
        done.sort(key=lambda x: x[0])
        return [(ci, starts) for _, ci, starts in done] + rest

    def _fill_starts(self, split, lower, starts, types, caps_t, overheads, table, lengths, n, deadline):
        """(the starts of one split, each micro-batch's replaced by its mixed layout from ``solver.fill`` where that
        is faster (or where no homogeneous layout packs it), True when every micro-batch was packed before
        `deadline`)."""
        new = list(starts)
        for j, (items, start) in enumerate(zip(split, starts, strict=True)):
            if time.monotonic() >= deadline:
                return new, False
            if start is not None and start.makespan() <= lower[j] * (1 + self.config.tolerance):
                continue  # already at its bound
            upper = start.makespan() if start is not None else 4.0 * lower[j]
            got = fill_draft(items, types, table, lengths, n, caps_t, overheads, lower[j], upper, deadline=deadline)
            if got is not None and (start is None or got.makespan() < start.makespan()):
                new[j] = got
        return new, True

    def _solve_split(
        self, split, lower_bounds, types, caps_t, overheads, table, lengths, n, deadline, starts, run, wait_until=None
    ):
        """([(draft, method)] for each micro-batch of one split, or None when one cannot be packed; True when every
        solve finished). A solve that is not back by `deadline`, or whose solver process died, leaves that
        micro-batch its static start (method 'timeout' / 'crash'); a crash restarts the solver process and the
        solve is retried while time is left."""
        cfg = self.config
        wait_until = deadline if wait_until is None else max(deadline, wait_until)  # the solves aim at `deadline`
        kw = dict(
            num_devices=n,
            caps_by_type=caps_t,
            overheads=overheads,
            max_buckets=cfg.max_buckets,
            tolerance=cfg.tolerance,
            max_bisection_steps=cfg.max_bisection_steps,
            ilp_time_limit_s=cfg.ilp_time_limit_s,
            solver=cfg.solver,
        )
        out: list = [None] * len(split)
        pending = list(range(len(split)))
        complete = True

        def give_up(idx) -> None:  # out of time: the static starts
            nonlocal complete
            complete = False
            run["cut"] += len(idx)
            for i in idx:
                out[i] = None if starts[i] is None else (starts[i], "timeout")

        while pending:
            lost: list[int] = []
            if deadline - time.monotonic() < MIN_SOLVE_S:
                give_up(pending)
                break
            if self._solver.isolate:  # all at once: the pool runs `workers` at a time
                jobs = [
                    self._job(split[i], lower_bounds[i], starts[i], types, table, lengths, kw, math.inf, deadline)
                    for i in pending
                ]
                for pos, job in enumerate(jobs):  # when it starts: its part of the time left (those after it share)
                    job["share_of"] = math.ceil((len(jobs) - pos) / cfg.workers)
                futs = [(i, self._solver.submit(job)) for i, job in zip(pending, jobs, strict=True)]
                self._step_bound()  # this process is free while the solver process works: the step's bound now
                if self._idle is not None:  # this process is free while the solver process works
                    self._idle(wait_until, lambda fs=futs: all(f.done() for _, f in fs))
            else:
                futs = [(i, None) for i in pending]
            for k, (i, fut) in enumerate(futs):
                if fut is None:  # in-process: one at a time, each with its share of the time now left
                    left = deadline - time.monotonic()
                    if left < MIN_SOLVE_S:
                        give_up([j for j, _ in futs[k:]])
                        break
                    job = self._job(
                        split[i],
                        lower_bounds[i],
                        starts[i],
                        types,
                        table,
                        lengths,
                        kw,
                        left / (len(futs) - k),
                        deadline,
                    )
                    fut = self._solver.submit(job)
                try:
                    got = fut.result(timeout=max(0.0, wait_until - time.monotonic()))
                except FutureTimeout:  # past its deadline: kill it (isolated) or stop waiting for it (a thread)
                    self._solver.restart()
                    rest = [j for j, f in futs[k:] if not _collect(f, j, split, out)] if self._solver.isolate else [i]
                    give_up(rest)
                    if self._solver.isolate:
                        break
                    continue
                except BrokenProcessPool:  # the solver process died (a native crash): retry while time is left
                    run["crashes"] += 1
                    self._solver.restart()
                    lost = [j for j, f in futs[k:] if not _collect(f, j, split, out)]
                    break
                if got is None:
                    return None, complete
                out[i] = (_to_global(got[0], split[i]), got[1])
            pending = lost
        if any(o is None for o in out):
            return None, complete
        return out, complete

    def _job(self, items, lower_bound, start, types, table, lengths, kw, budget, deadline) -> dict:
        crash = self._inject_crashes > 0
        if crash:
            self._inject_crashes -= 1
        items = list(items)
        return {
            "table": table[items],
            "lengths": lengths[items],
            "types": types,
            "lower_bound_ms": lower_bound,
            "start": None if start is None else _to_local(start, items),
            "kw": kw,
            "budget_s": budget,
            "deadline": deadline,
            "crash": crash,
            "share_of": 1,
        }

    def _split_until_packed(self, items, types, caps_t, overheads, table, lengths, n) -> list[Draft]:
        """Always succeeds: one sequence alone fits the largest group (check_batch guarantees it)."""
        got = best_homogeneous_draft(items, types, table, lengths, n, caps_t, overheads)
        if got is not None:
            return [got]
        half = len(items) // 2
        args = (types, caps_t, overheads, table, lengths, n)
        return self._split_until_packed(items[:half], *args) + self._split_until_packed(items[half:], *args)


def _polish(sols, caps_t, table, lengths, overheads, deadline) -> tuple[float, list]:
    """(step time, [(draft, method)]) after the local search over a split's solved micro-batches (`sols`, changed in
    place); a micro-batch the search emptied is dropped."""
    drafts = [d for d, _ in sols]
    caps = [caps_t[np.asarray(d.group_type, dtype=np.int64)] for d in drafts]
    improve_step(drafts, caps, table, lengths, overheads, deadline=deadline)
    return sum(d.makespan() for d in drafts), [(d, m) for d, m in sols if any(d.members)]


def _collect(fut: Future | None, i: int, split, out) -> bool:
    """Put a solve that finished before its pool went down into `out`; False when it did not."""
    if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None or fut.result() is None:
        return False
    draft, method = fut.result()
    out[i] = (_to_global(draft, split[i]), method)
    return True


def _to_local(draft: Draft, items: list[int]) -> Draft:
    pos = {g: j for j, g in enumerate(items)}
    return Draft(
        list(draft.group_type), [[pos[i] for i in m] for m in draft.members], draft.loads.copy(), draft.tokens.copy()
    )


def _to_global(draft: Draft, items) -> Draft:
    items = list(items)
    return Draft(list(draft.group_type), [[items[j] for j in m] for m in draft.members], draft.loads, draft.tokens)


def plan_step(lengths, num_devices: int, profile: Profile, config: PlannerConfig | None = None) -> StepPlan:
    """Plan one step (a convenience wrapper around `Planner`)."""
    with Planner(profile, config) as planner:
        return planner.plan(lengths, num_devices)
