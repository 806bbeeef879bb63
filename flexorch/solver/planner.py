"""The per-step planner: lengths + N devices + profile in, a frozen `Plan` out, in the one plan result
(``solver.planned_step.PlannedStep``) that the step planner then adds the BatchAda floor and the baselines to.

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
of N/2 side by side (``solver.halves``: FlexSP's solver chooses such layouts, arXiv 2412.01523 §4.1.1).

A plan is screen -> solve -> polish -> finish (:meth:`Planner._plan`), each stage by its deadline of the plan's
``solver.budget.Budget``, over the step's tables (``solver.step_tables``).
"""

from __future__ import annotations

import copy
import functools
import time
from dataclasses import dataclass, field

import numpy as np

from flexorch.solver.bounds import micro_batch_bound_ms, step_bound_ms
from flexorch.solver.budget import Budget, measured
from flexorch.solver.errors import PlanningError
from flexorch.solver.halves import split_halves
from flexorch.solver.microbatching import partition_candidates
from flexorch.solver.paced import fastest_layout, leveled_solve
from flexorch.solver.packing import (
    Draft,
    best_homogeneous_draft,
    drop_empty,
    improve_step,
)
from flexorch.solver.plan import Plan
from flexorch.solver.planned_step import OUT_OF_TIME, PlannedStep
from flexorch.solver.planner_config import PlannerConfig
from flexorch.solver.profiles import Profile
from flexorch.solver.screening import screen_splits
from flexorch.solver.simulator import step_time_ms
from flexorch.solver.split_solver import MIN_SOLVE_S, SplitSolver
from flexorch.solver.step_tables import StepTables, split_tiers, step_tables
from flexorch.solver.topology import Topology
from flexorch.solver.validation import check_batch, check_num_devices

__all__ = ["PlannerConfig", "Planner", "plan_step"]

LEVELED_MORE = 1
"""On ranks of different speeds: candidate splits of more micro-batches than the best one solved leveled too."""
NOMINAL_SHARE = 0.4
"""On ranks of different speeds: the share of the budget the search at one pace on every rank gets (first: the
split every other layout starts from, and the plan if time runs out)."""
FAST_SHARE = 0.25
"""On ranks of different speeds: the share the search at one pace on the fast ranks only gets (the leveled solves
get the rest)."""
FAST_WITHIN = 0.8
"""The fast ranks: those at least this share of the fastest rank's speed."""


@dataclass
class _Search:
    """The candidate splits, their bounds and order, and the best plan found among them so far."""

    cands: list
    mb_bounds: list
    """Each candidate's micro-batches' lower bounds (``solver.bounds.micro_batch_bound_ms``)."""
    bounds: list
    """Each candidate's bound: its micro-batches' bounds summed."""
    order: list
    """(candidate, its static starts or None) in the order to solve them (``solver.screening.screen_splits``)."""
    best_total: float = np.inf
    best_mbs: list | None = None
    """[(draft, method)] of the best split, after the local search."""
    best_pre: tuple | None = None
    """(candidate, its micro-batches' solutions before the local search) of the best split."""
    finished: bool = False
    """Some split was planned: its solves all came back, or ``solver.fill`` packed it."""
    laid: list = field(default_factory=list)
    """On ranks of different speeds, the leveled solves (``solver.paced.leveled_solve``): each one's (drafts, types,
    table, caps, overheads), laid out beside the best split (``solver.paced.fastest_layout``)."""
    tried: int = 0


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

    def add_probe(self, probe) -> None:
        """Call ``probe.at("solve", job)`` as each MILP solve's job is made (``solver.split_solver``); tests add
        ``flexorch.testing.faults.SolverCrash``."""
        self._solves.probes.append(probe)

    def close(self) -> None:
        self._solves.close()

    def __enter__(self) -> Planner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def plan(self, lengths, num_devices: int, deadline: float | None = None, idle=None, topology=None) -> PlannedStep:
        """Plan one step by ``deadline`` (a ``time.monotonic()`` value; default: ``time_limit_s`` from now), without
        the BatchAda floor (:class:`~flexorch.solver.step_planner.StepPlanner` adds it).

        The answer's ``status`` is 'milp' (a MILP plan beat the start), 'static' (none did, or none was solved
        because the start was within the tolerance of its bound, method 'bound': the start, homogeneous or
        ``solver.fill``'s mixed layout, stands) or :data:`~flexorch.solver.planned_step.OUT_OF_TIME` (time ran out
        before any candidate split was solved or packed by ``solver.fill``: homogeneous starts, solves cut at the
        deadline); its ``details`` say how the time went.

        ``idle(until, stop)``: work of the caller's to do here while MILP solves run in the solver process (the
        baselines), until ``until`` or until ``stop()`` says the solves are back. ``topology``
        (``solver.topology.Topology`` of ``num_devices`` ranks): groups are priced by where they will lie, placed
        on the nodes (``solver.placement``) and the plan carries it; None: one node (no inter-node prices)."""
        if topology is not None and topology.num_devices != num_devices:
            raise ValueError(
                f"topology has {topology.num_devices} ranks ({topology.describe()}), num_devices is {num_devices}"
            )
        self._idle = idle
        try:
            return self._plan(lengths, num_devices, deadline, topology)
        finally:
            self._idle = None

    def _plan(self, lengths, num_devices: int, deadline: float | None, topology=None) -> PlannedStep:
        """screen -> solve -> polish -> finish, each by its deadline of the plan's :class:`Budget`."""
        t0 = time.monotonic()
        deadline = t0 + self.config.time_limit_s if deadline is None else deadline
        check_num_devices(num_devices)
        lengths = check_batch(lengths, num_devices, self.profile)
        step = step_tables(lengths, int(num_devices), self.profile, self.config, topology)
        # the step's bound is reported, not used to plan: computed while the first MILPs run (or at the end)
        self._bound = functools.partial(
            step_bound_ms, step.table, step.types, lengths, step.n, step.cap, step.overheads, slowest=step.slowest
        )
        paced = topology is not None and not topology.uniform_speed
        run = {"crashes": 0, "cut": 0}
        # on ranks of different speeds: the search at one pace on every rank, then on the fast ranks alone, each by
        # its share of the time, then the leveled solves
        until = t0 + NOMINAL_SHARE * (deadline - t0) if paced else deadline
        budget = Budget.split(t0, until, lengths.size, self._finish_s, self._polish_s)
        search = self._screen(step, budget)
        self._solve(step, search, budget, run)
        if not paced:  # on ranks of different speeds the leveled solves take that time
            self._polish_best(step, search, budget, run)
        if paced:
            search.laid += self._solve_fast_ranks(step, t0 + (NOMINAL_SHARE + FAST_SHARE) * (deadline - t0), run)
            budget = Budget.split(t0, deadline, lengths.size, self._finish_s, self._polish_s)
            self._solve_leveled(step, search, budget, run)
        return self._finish(step, search, budget, run)

    def _solve_fast_ranks(self, step: StepTables, until: float, run: dict) -> list[tuple]:
        """On ranks of different speeds: the step searched at one pace on the fast ranks alone (``FAST_WITHIN``),
        by ``until``; its best split as a layout for ``_Search.laid`` (a list of none or one). Placed on every rank,
        its groups take the fastest slots and leave the slow ranks free, and the paced local search gives those
        what they can finish in time (``solver.paced``): the layout that keeps a slow worker out of the long
        sequences' groups, found at the cost of a speed-blind solve. None where no rank is slow, or the fast ranks
        cannot hold the batch."""
        fast = fast_ranks(step.topology)
        if fast is None:
            return []
        try:
            sub = step_tables(step.lengths, fast.num_devices, self.profile, self.config, fast)
        except PlanningError:  # some sequence needs more devices than the fast ranks have
            return []
        budget = Budget.split(time.monotonic(), until, step.lengths.size, self._finish_s, self._polish_s)
        if budget.solve - time.monotonic() < MIN_SOLVE_S:
            return []
        found = self._screen(sub, budget)
        self._solve(sub, found, budget, run)
        if found.best_mbs is None:
            return []
        return [([d for d, _ in found.best_mbs], sub.types, sub.table, sub.caps_t, sub.overheads)]

    def _solve_leveled(self, step: StepTables, search: _Search, budget: Budget, run: dict) -> None:
        """On ranks of different speeds: the best split and up to ``LEVELED_MORE`` candidate splits of more
        micro-batches solved again with each type once per speed level (``solver.paced.leveled_solve``), each by
        its share of the time left. More, lighter micro-batches let a slow rank take less where every micro-batch of
        the best split is full (a memory-bound batch: the slow rank's group would hold as much as the others)."""
        if not search.order:
            return
        solved = search.best_mbs is not None and search.best_pre is not None
        best = search.best_pre[0] if solved else search.order[0][0]  # none solved in time: the first in order
        more = [ci for ci, _ in search.order if len(search.cands[ci]) > len(search.cands[best])][:LEVELED_MORE]
        for k, ci in enumerate([best, *more]):
            left = budget.solve - time.monotonic()
            if left < MIN_SOLVE_S:
                break
            if ci == best and solved:
                drafts = [d for d, _ in search.best_mbs]
            else:
                drafts = step.homogeneous_starts(search.cands[ci], deadline=budget.solve)
                if any(d is None for d in drafts):
                    continue
            until = time.monotonic() + left / (1 + len(more) - k)
            laid = leveled_solve(step, drafts, self._solves, until, run, self._while_solving)
            if laid is not None:
                search.laid.append(laid)

    def _screen(self, step: StepTables, budget: Budget) -> _Search:
        """The candidate splits, their bounds, and the order to solve them in (``solver.screening``)."""
        cfg = self.config
        tiers = split_tiers(step, cfg) if cfg.tiered_splits else None
        kinds: list[str] = []
        cands = partition_candidates(
            step.lengths,
            step.area,
            int(step.cap * _paced_devices(step.topology, step.n)),
            cfg.extra_micro_batches,
            deadline=budget.screen,
            tiers=tiers,
            kinds=kinds,
        )
        mb_bounds = [[micro_batch_bound_ms(step.table[c], step.deg, step.n, step.overheads) for c in s] for s in cands]
        bounds = [sum(b) for b in mb_bounds]
        # the splits in the order to solve them, and those whose every micro-batch solver.fill packed
        screened = screen_splits(step, cands, kinds, bounds, mb_bounds, budget.screen, budget.fill, config=cfg)
        order, self._filled = screened
        return _Search(cands, mb_bounds, bounds, order)

    def _solve(self, step: StepTables, search: _Search, budget: Budget, run: dict) -> None:
        """Each candidate split in order whose bound can beat the best so far: its MILPs, then the local search."""
        halves_of = step.types if self.config.halves else None  # the local search splits slow groups in half
        for ci, starts in search.order:
            if search.bounds[ci] >= search.best_total:
                continue
            if search.best_mbs is not None and time.monotonic() + MIN_SOLVE_S >= budget.solve:
                break
            if starts is None:  # not screened: its static starts now (each micro-batch's best homogeneous layout)
                starts = step.homogeneous_starts(search.cands[ci], deadline=budget.solve)
            sols, complete = self._solve_split(step, search, ci, starts, budget, run)
            search.tried += 1
            if sols is None:
                continue  # some micro-batch of this split cannot be packed
            search.finished |= complete or ci in self._filled  # a split packed by solver.fill is planned, cut or not
            pre = [(copy.deepcopy(d), m) for d, m in sols]  # before the local search (it changes drafts in place)
            p0 = time.monotonic()
            total, kept = _polish(sols, step.caps_t, step.table, step.lengths, step.overheads, budget.polish, halves_of)
            self._polish_s = measured(self._polish_s, time.monotonic() - p0)
            if total < search.best_total:
                search.best_total, search.best_mbs, search.best_pre = total, kept, (ci, pre)
            if self._at_bound(search):
                break  # proven within the tolerance of optimal: no split can do better by more

    def _solve_split(self, step: StepTables, search: _Search, ci: int, starts, budget: Budget, run: dict):
        """``SplitSolver.solve`` of candidate `ci` from `starts`, by the solve deadline."""
        split, lower = search.cands[ci], search.mb_bounds[ci]
        return self._solves.solve(step, split, lower, budget.solve, starts, run, budget.polish, self._while_solving)

    def _polish_best(self, step: StepTables, search: _Search, budget: Budget, run: dict) -> None:
        """With time left (``fill_starts``): the best split's MILPs again from the homogeneous starts (the bisection
        is not monotone in its start), each micro-batch keeping the better of the two."""
        if not self.config.fill_starts or search.best_pre is None or self._at_bound(search):
            return
        if time.monotonic() + 2 * MIN_SOLVE_S >= budget.solve:
            return
        got = self._second_pass(step, search, *search.best_pre, budget, run)
        if got is not None and got[0] < search.best_total:
            search.best_total, search.best_mbs = got

    def _finish(self, step: StepTables, search: _Search, budget: Budget, run: dict) -> PlannedStep:
        """The plan of the best split (or, none packing, of micro-batches halved until each packs) and its report."""
        t_finish = time.monotonic()
        lengths, n, prof = step.lengths, step.n, self.profile
        if search.best_mbs is None:  # no candidate split packs: halve micro-batches until each one does
            drafts = self._split_until_packed(sorted(range(len(lengths)), key=lambda i: -lengths[i]), *step.packing)
            caps = [step.caps_t[np.asarray(d.group_type, dtype=np.int64)] for d in drafts]
            improve_step(drafts, caps, step.table, lengths, step.overheads, deadline=budget.polish)
            drafts = drop_empty(drafts)
            search.best_total, search.best_mbs = sum(d.makespan() for d in drafts), [(d, "fallback") for d in drafts]
        if not search.finished:
            status = OUT_OF_TIME
        else:
            status = "milp" if any(m in ("milp", "exact") for _, m in search.best_mbs) else "static"
        topo = step.topology
        meta = {"planner": "flexorch-milp", "status": status}
        layouts = [([d for d, _ in search.best_mbs], step.types, step.table, step.caps_t, step.overheads)]
        layouts += search.laid  # ranks of different speeds: the splits solved leveled

        def make(mbs) -> Plan:
            return Plan.for_profile(num_devices=n, seq_lengths=lengths, micro_batches=mbs, profile=prof, meta=meta,
                                    topology=topo)  # fmt: skip

        plan = fastest_layout(layouts, lengths, topo, make, lambda p: step_time_ms(p, prof),
                              deadline=budget.polish + 0.5 * (budget.end - budget.polish))  # fmt: skip
        mbs = plan.micro_batches
        bound = self._step_bound()  # computed already if a MILP ran in the solver process; else now (in `finish`)
        if topo is not None:  # at one pace; ranks faster than 1.0 may beat it by their speed
            bound /= max(1.0, *topo.rank_speeds())
        done = time.monotonic()
        self._finish_s = measured(self._finish_s, done - t_finish)
        self.crashes_total += run["crashes"]
        details = {
            "candidates": len(search.cands),
            "candidates_solved": search.tried,
            "micro_batches": len(mbs),
            "methods": [m for _, m in search.best_mbs],
            "time_limit_s": round(budget.given, 4),
            "used_s": round(done - budget.t0, 4),
            "solver_crashes": run["crashes"],
            "solves_cut": run["cut"],
            "isolated": self._solves.pool.isolate,
        }
        # the step's fixed costs (sync, optimizer) on both: ``simulator.step_time_ms``'s price, and still a bound
        total_ms = float(search.best_total) + prof.step_ms
        if topo is not None:  # priced where the groups were placed (a group the nodes had no room for spans them)
            total_ms = step_time_ms(plan, prof)
            bound = min(bound, total_ms - prof.step_ms)  # the bound's types are priced no slower than placed ones
        return PlannedStep(
            plan,
            total_ms,
            bound + prof.step_ms,
            done - budget.t0,
            status,
            details=details,
            solver_crashes=run["crashes"],
        )

    def _at_bound(self, search: _Search) -> bool:
        """The best plan so far is within ``tolerance`` of the step's proven bound (``stop_at_bound``)."""
        if not self.config.stop_at_bound or search.best_mbs is None:
            return False
        return search.best_total <= self._step_bound() * (1 + self.config.tolerance)

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

    def _second_pass(self, step: StepTables, search: _Search, ci: int, pre, budget: Budget, run: dict):
        """(step time, [(draft, method)]) of split `ci` solved again from homogeneous starts, each micro-batch the
        better of that and `pre` (the first pass), after the local search; None when nothing got better."""
        starts = step.homogeneous_starts(search.cands[ci], deadline=budget.solve)
        if any(s is None for s in starts):
            return None
        sols, _ = self._solve_split(step, search, ci, starts, budget, run)
        if sols is None:
            return None
        merged = [b if b[0].makespan() < a[0].makespan() else a for a, b in zip(pre, sols, strict=True)]
        if all(m is a for m, a in zip(merged, pre, strict=True)):
            return None
        merged = [(copy.deepcopy(d), m) for d, m in merged]
        halves_of = step.types if self.config.halves else None
        return _polish(merged, step.caps_t, step.table, step.lengths, step.overheads, budget.polish, halves_of)

    def _split_until_packed(self, items, types, caps_t, overheads, table, lengths, n) -> list[Draft]:
        """Always succeeds: one sequence alone fits the largest group (check_batch guarantees it)."""
        got = best_homogeneous_draft(items, types, table, lengths, n, caps_t, overheads)
        if got is not None:
            return [got]
        half = len(items) // 2
        args = (types, caps_t, overheads, table, lengths, n)
        return self._split_until_packed(items[:half], *args) + self._split_until_packed(items[half:], *args)


def fast_ranks(topology) -> Topology | None:
    """The nodes of ``topology``'s fast ranks alone (speed at least ``FAST_WITHIN`` of the fastest; a node left
    with none is dropped), at one pace; None where every rank is fast (or none is)."""
    if topology is None or topology.uniform_speed:
        return None
    speeds = topology.rank_speeds()
    top = max(speeds)
    keep = [r for r, v in enumerate(speeds) if v >= FAST_WITHIN * top]
    if len(keep) == len(speeds):
        return None
    counts = [0] * topology.num_nodes
    for r in keep:
        counts[topology.node_of(r)] += 1
    names = tuple(n for n, c in zip(topology.names(), counts, strict=True) if c) if topology.node_names else ()
    return Topology(tuple(c for c in counts if c), names)


def _paced_devices(topology, n: int) -> float:
    """The devices a micro-batch's tokens are sized for: ``n``, less what slow ranks lack (a rank at speed s < 1
    counts s), so on ranks of different speeds a memory-bound batch is cut into lighter micro-batches in which a
    slow rank can take less than its memory holds (``solver.paced``)."""
    if topology is None or topology.uniform_speed:
        return n
    return float(sum(min(1.0, v) for v in topology.rank_speeds()))


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


def plan_step(lengths, num_devices: int, profile: Profile, config: PlannerConfig | None = None) -> PlannedStep:
    """Plan one step (a convenience wrapper around `Planner`)."""
    with Planner(profile, config) as planner:
        return planner.plan(lengths, num_devices)
