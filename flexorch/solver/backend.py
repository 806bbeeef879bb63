"""Which MILP solver python-mip drives: HiGHS (``highsbox``'s C library) or CBC (``cbcbox``).

Every MILP in the planner is built through :func:`new_model`, so the backend is one setting (``plan.solver``).
python-mip 2.0 loads HiGHS's C library from the ``highsbox`` package on Linux (the ``highspy`` wheel does not export
the C API); CBC ships with python-mip. CBC's build has open reports of native crashes on small binary models
(coin-or/Cbc#693), so whatever the backend the planner runs its solves where a crash costs that solve only
(``solver.planner``).
"""

from __future__ import annotations

import functools

import mip

__all__ = ["DEFAULT_SOLVER", "SOLVERS", "check_solver", "new_model", "solver_available"]

SOLVERS = ("highs", "cbc")
DEFAULT_SOLVER = "highs"
"""Chosen by measurement: ``benchmarks/solver_backends.py`` (plan quality, solve time, crashes, quiet and beside
CPU hogs)."""

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
    """A silent, single-threaded minimisation model on backend ``solver``."""
    m = mip.Model(sense=mip.MINIMIZE, solver_name=_MIP_NAMES[solver])
    m.verbose = 0
    m.threads = 1
    return m
