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

Around the search here: its knobs (``solver.planner_config``), the screening that orders candidate splits by their
static starts (``solver.screening``), the deadline-bound solves of one split's micro-batches
(``solver.split_solver``) and the slowest sequences laid out on the groups they run on, one of all N devices or two
of N/2 side by side (``solver.halves``, issue 48: FlexSP's solver chose such layouts where ours did not).
"""

from __future__ import annotations

import copy
import functools
import time
from dataclasses import dataclass, field

import numpy as np

from flexorch.solver.bounds import area_and_min_time, micro_batch_bound_ms, step_bound_ms
from flexorch.solver.errors import InfeasibleBatchError
from flexorch.solver.halves import light_fill, plan_rounds, split_halves, tier_devices
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
from flexorch.solver.planner_config import PlannerConfig
from flexorch.solver.profiles import Profile
from flexorch.solver.round_bounds import best_round_split, slowest_fronts
from flexorch.solver.screening import screen_splits
from flexorch.solver.split_solver import MIN_SOLVE_S, SplitSolver
from flexorch.solver.validation import check_batch, check_num_devices

__all__ = ["PlannerConfig", "StepPlan", "Planner", "plan_step"]


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
        self._solves = SplitSolver(self.config)
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
        self._solves.crashes_to_inject = int(crashes)

    def close(self) -> None:
        self._solves.close()

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
            need = deg[np.argmax(np.isfinite(table), axis=1)].astype(np.int64)
            # the slowest sequences' micro-batches as the rounds bound places them, each chain on its least degree
            # (the relaxed fronts: every chain on its least degree), a start
            relaxed = slowest_fronts(table, deg, lengths, n, cap, per_degree=False) if cfg.round_splits else None
            rounds = best_round_split(*relaxed) if cfg.round_splits else None
            halves = None
            if cfg.halves:  # and as they run: one group of N, or two of N/2 each running a share (solver.halves)
                g = light_fill(table, deg, lengths, slowest[0], n, cap)
                halves = (tier_devices(need, *slowest, g, n), plan_rounds(*slowest, g, n) if cfg.round_splits else None)
            tiers = (wall, need, n, own, rounds, halves)
        kinds: list[str] = []
        cands = partition_candidates(
            lengths, area, n * cap, cfg.extra_micro_batches, deadline=screen_deadline, tiers=tiers, kinds=kinds
        )
        mb_bounds = [[micro_batch_bound_ms(table[c], deg, n, overheads) for c in split] for split in cands]
        bounds = [sum(b) for b in mb_bounds]
        fill_deadline = t0 + 0.6 * max(0.0, solve_deadline - t0)
        # the splits in the order to solve them, and those whose every micro-batch solver.fill packed
        order, self._filled = screen_splits(
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
            cap=cap,
            config=cfg,
        )
        best_total, best_mbs, finished, tried = np.inf, None, False, 0
        halves_of = types if cfg.halves else None  # the local search splits slow groups in half (solver.halves)
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
            sols, complete = self._solves.solve(
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
                idle=self._while_solving,
            )
            tried += 1
            if sols is None:
                continue  # some micro-batch of this split cannot be packed
            finished |= complete or ci in self._filled  # a split packed by solver.fill is planned, MILPs cut or not
            pre = [(copy.deepcopy(d), m) for d, m in sols]  # before the local search (it changes drafts in place)
            p0 = time.monotonic()
            total, kept = _polish(sols, caps_t, table, lengths, overheads, polish_deadline, halves_of)
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
            "isolated": self._solves.pool.isolate,
        }
        # the step's fixed costs (sync, optimizer) on both: ``simulator.step_time_ms``'s price, and still a bound
        return StepPlan(plan, float(best_total) + prof.step_ms, bound + prof.step_ms, done - t0, status, details)

    def _step_bound(self) -> float:
        """The step's lower bound (``solver.bounds.step_bound_ms``), computed once per plan, on first call."""
        if callable(self._bound):
            self._bound = float(self._bound())
        return self._bound

    def _while_solving(self, until: float, stop) -> None:
        """This process's work while the solver process works: the step's bound, then the caller's ``idle``."""
        self._step_bound()  # this process is free while the solver process works: the step's bound now
        if self._idle is not None:
            self._idle(until, stop)

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
        sols, _ = self._solves.solve(
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
            idle=self._while_solving,
        )
        if sols is None:
            return None
        merged = [b if b[0].makespan() < a[0].makespan() else a for a, b in zip(pre, sols, strict=True)]
        if all(m is a for m, a in zip(merged, pre, strict=True)):
            return None
        merged = [(copy.deepcopy(d), m) for d, m in merged]
        halves_of = types if self.config.halves else None
        return _polish(merged, caps_t, table, lengths, overheads, polish_deadline, halves_of)

    def _split_until_packed(self, items, types, caps_t, overheads, table, lengths, n) -> list[Draft]:
        """Always succeeds: one sequence alone fits the largest group (check_batch guarantees it)."""
        got = best_homogeneous_draft(items, types, table, lengths, n, caps_t, overheads)
        if got is not None:
            return [got]
        half = len(items) // 2
        args = (types, caps_t, overheads, table, lengths, n)
        return self._split_until_packed(items[:half], *args) + self._split_until_packed(items[half:], *args)


def _polish(sols, caps_t, table, lengths, overheads, deadline, types=None) -> tuple[float, list]:
    """(step time, [(draft, method)]) after the local search over a split's solved micro-batches (`sols`, changed in
    place); a micro-batch the search emptied is dropped. With `types` (``PlannerConfig.halves``), slow groups are
    first split in two half-size groups where that is faster (``solver.halves.split_halves``)."""
    drafts = [d for d, _ in sols]
    first = deadline
    if types is not None:  # a quarter of the time left for a second look after the moves (they may make room)
        split_halves(drafts, types, table, lengths, caps_t, overheads, deadline=deadline)
        first = deadline - 0.25 * max(0.0, deadline - time.monotonic())
    caps = [caps_t[np.asarray(d.group_type, dtype=np.int64)] for d in drafts]
    improve_step(drafts, caps, table, lengths, overheads, deadline=first)
    if types is not None and split_halves(drafts, types, table, lengths, caps_t, overheads, deadline=deadline):
        caps = [caps_t[np.asarray(d.group_type, dtype=np.int64)] for d in drafts]
        improve_step(drafts, caps, table, lengths, overheads, deadline=deadline)
    return sum(d.makespan() for d in drafts), [(d, m) for d, m in sols if any(d.members)]


def plan_step(lengths, num_devices: int, profile: Profile, config: PlannerConfig | None = None) -> StepPlan:
    """Plan one step (a convenience wrapper around `Planner`)."""
    with Planner(profile, config) as planner:
        return planner.plan(lengths, num_devices)
