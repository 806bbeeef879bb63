"""Which MILP solver python-mip drives: HiGHS (``highsbox``'s C library) or CBC (``cbcbox``), and how long a solve
may run.

Every MILP in the planner is built through :func:`new_model` and solved through :func:`optimize`, so the backend is
one setting (``plan.solver``) and no solve is given more time than is left before its caller's deadline.
python-mip 2.0 loads HiGHS's C library from the ``highsbox`` package on Linux (``mip/highs.py``: ``highspy`` first
when installed, else ``highsbox.highs_dist_dir()/lib/libhighs.so``); CBC ships with python-mip. CBC's build has open
reports of native crashes on small binary models (coin-or/Cbc#693: SIGSEGV on an 8-variable model; here
``CglPreProcess::postProcess`` SIGSEGV and double-free aborts when a time limit ends its preprocessing on a starved
CPU), so whatever the backend the planner runs its solves where a crash costs that solve only (``solver.planner``).

What python-mip 2.0's HiGHS interface does with the settings the planner uses (read from ``mip/highs.py``):

- ``m.start``: ``Highs_setSolution`` with every variable not named set to 0 (a partial start is completed with
  zeros, not left free); an infeasible start is ignored. A time-limited solve that holds the start reports FEASIBLE.
- ``max_seconds``: HiGHS's ``time_limit`` option (wall clock), set only when finite.
- ``max_mip_gap`` / ``max_mip_gap_abs``: ``mip_rel_gap`` / ``mip_abs_gap``, set on every optimize.
- ``threads``: HiGHS's ``threads`` option. HiGHS's task scheduler is process-wide and fixed by the first run: a later
  run asking for another count fails (``InterfacingError: Unknown error in call to HiGHS``). Every model here
  asks for 1, so all HiGHS solves in a process must come through :func:`new_model`.
- statuses: OPTIMAL; FEASIBLE when a limit stopped it holding a solution; NO_SOLUTION_FOUND without one;
  INFEASIBLE. ``objective_bound`` is HiGHS's ``mip_dual_bound``.

CBC's ``max_seconds`` is CBC's ``seconds`` limit. Both limits are wall clock here, so a solve starved of CPU may
reach its limit having used a fraction of it in CPU time - which is how a starved CBC reaches its limit inside
preprocessing.

HiGHS runs on its defaults: the variants tried (presolve off, symmetry detection off, ``mip_heuristic_effort`` 0.3,
the feasibility jump off) answered no more of the planner's bisection MILPs correctly at short limits (the figures
are in docs/guide/planner.md).
"""

from __future__ import annotations

import functools
import math
import time

import mip

__all__ = [
    "DEFAULT_SOLVER",
    "MIN_SOLVE_S",
    "SOLVED",
    "SOLVERS",
    "check_solver",
    "new_model",
    "optimize",
    "solver_available",
    "time_left",
]

SOLVERS = ("highs", "cbc")
DEFAULT_SOLVER = "highs"
"""Chosen by measurement: ``benchmarks/sim/solver_backends.py`` (plan quality, solve time, crashes, quiet and beside
CPU hogs; the figures are in its docstring)."""

MIN_SOLVE_S = 0.02
"""The least time limit a solve is given, even past its caller's deadline: enough for either backend to read back
the warm start it was given (a limit of 0 returns no solution at all)."""

SOLVED = (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE)
"""Statuses after which the model holds a solution (python-mip maps a limit hit with an incumbent to FEASIBLE)."""

_MIP_NAMES = {"highs": mip.HIGHS, "cbc": mip.CBC}


@functools.cache
def solver_available(name: str) -> tuple[bool, str]:
    """(True, '') when python-mip can load backend ``name`` here, else (False, why and what to install)."""
    if name not in _MIP_NAMES:
        return False, f"unknown MILP solver {name!r}; choose one of {list(SOLVERS)}"
    try:
        mip.Model(solver_name=_MIP_NAMES[name])
    except Exception as e:  # noqa: BLE001 - python-mip raises several types when a library is missing
        hint = "pip install highsbox" if name == "highs" else "pip install cbcbox"
        return False, f"python-mip cannot load the {name} solver ({type(e).__name__}: {e}); `{hint}`"
    return True, ""


def check_solver(name: str) -> None:
    """Raise ValueError naming the problem and the fix when backend ``name`` cannot be used here."""
    ok, why = solver_available(name)
    if not ok:
        raise ValueError(why)


def new_model(solver: str) -> mip.Model:
    """A silent, single-threaded minimisation model on backend ``solver`` ('highs' or 'cbc'); ValueError for any
    other name, or when python-mip cannot load that backend here."""
    check_solver(solver)
    m = mip.Model(sense=mip.MINIMIZE, solver_name=_MIP_NAMES[solver])
    m.verbose = 0
    m.threads = 1  # the planner's solves overlap training: one core each (and HiGHS's scheduler wants one count)
    return m


def time_left(deadline: float, cap: float = math.inf, floor: float = MIN_SOLVE_S) -> float:
    """Seconds a solve may take now: what is left before ``deadline`` (a ``time.perf_counter()`` instant), at most
    ``cap``, at least ``floor``."""
    return max(floor, min(cap, deadline - time.perf_counter()))


def optimize(m: mip.Model, deadline: float, cap: float = math.inf) -> mip.OptimizationStatus:
    """Solve ``m`` with the time left before ``deadline`` (at most ``cap`` seconds, at least :data:`MIN_SOLVE_S`),
    measured when the solve starts, so the time spent building the model counts against the deadline."""
    return m.optimize(max_seconds=time_left(deadline, cap))
