"""A plan's deadlines, all cut from the one :meth:`flexorch.solver.planner.Planner.plan` was given, and the
hand-tuned shares and reserves that cut them, in one place.

From the deadline as given: a margin for the clock reads; before it, the time to build the plan (``finish``); before
that, the local search over the best split (``polish``); the MILP solves aim at what is left (``solve``), and the
candidate splits are made and screened (``screen``) and packed by ``solver.fill`` (``fill``) in the first shares of
the time up to it. The reserves are what that work took in the plan before (measured by the planner, x1.5), a guess
by the batch's size before the first plan, and at most a fixed share of the budget each, so a short budget still
leaves time to solve.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Budget", "measured"]

CLOCK_MARGIN_S = 0.003
"""Kept back from the deadline for the clock reads between the checks, plus ``CLOCK_MARGIN_SHARE`` of the time given."""
CLOCK_MARGIN_SHARE = 0.01
FINISH_GUESS_S, FINISH_GUESS_PER_SEQ_S = 0.005, 4e-6
"""Building the plan after the last solve, before it was first measured: a fixed part and a part per sequence."""
POLISH_GUESS_S, POLISH_GUESS_PER_SEQ_S = 0.01, 1e-5
"""The local search over a solved split, before it was first measured: a fixed part and a part per sequence."""
RESERVE_FACTOR, RESERVE_PAD_S = 1.5, 0.005
"""A reserve is what the work took last time (or the guess) times ``RESERVE_FACTOR``, plus ``RESERVE_PAD_S``."""
FINISH_SHARE_MAX = 0.15
"""The reserve for building the plan (after the local search) is at most this share of the budget."""
POLISH_SHARE_MAX = 0.3
"""The reserve for the local search and building the plan (after the solves) is at most this share of the budget."""
SCREEN_SHARE = 0.3
"""The candidate splits are made and screened in this share of the time up to the solve deadline."""
FILL_SHARE = 0.6
"""``solver.fill`` packs the screened splits until this share of the time up to the solve deadline."""


@dataclass(frozen=True)
class Budget:
    """One plan's deadlines (``time.monotonic()`` values), all cut from the one it was given, in this order:
    ``screen`` <= ``fill`` <= ``solve`` <= ``polish`` <= ``end``. The local search and building the plan keep the
    time they took last time (x1.5, measured by the planner), at most a fixed share of the budget each."""

    t0: float
    given: float
    """Seconds from ``t0`` to the deadline as given (reported as 'time_limit_s')."""
    end: float
    """The deadline less the margin for the clock reads: the plan is built by then."""
    polish: float
    """The local search stops here, leaving the time to build the plan."""
    solve: float
    """The MILP solves aim at this, leaving the time for the local search and building the plan."""
    screen: float
    """Making and screening the candidate splits stops here."""
    fill: float
    """``solver.fill`` packs screened splits until here."""

    @classmethod
    def split(cls, t0: float, deadline: float, num_seqs: int, finish_s: float | None, polish_s: float | None):
        """The deadlines of a plan started at ``t0`` with ``num_seqs`` sequences, from the measured times of
        building the plan (``finish_s``) and of the local search (``polish_s``); None: not measured yet."""
        given = deadline - t0
        end = deadline - (CLOCK_MARGIN_S + CLOCK_MARGIN_SHARE * max(0.0, given))
        finish = finish_s if finish_s is not None else FINISH_GUESS_S + FINISH_GUESS_PER_SEQ_S * num_seqs
        polish = polish_s if polish_s is not None else POLISH_GUESS_S + POLISH_GUESS_PER_SEQ_S * num_seqs
        budget = max(0.0, end - t0)
        polish_deadline = end - min(RESERVE_FACTOR * finish + RESERVE_PAD_S, FINISH_SHARE_MAX * budget)
        solve_deadline = end - min(RESERVE_FACTOR * (finish + polish) + RESERVE_PAD_S, POLISH_SHARE_MAX * budget)
        screen_deadline = t0 + SCREEN_SHARE * max(0.0, solve_deadline - t0)
        fill_deadline = t0 + FILL_SHARE * max(0.0, solve_deadline - t0)
        return cls(t0, given, end, polish_deadline, solve_deadline, screen_deadline, fill_deadline)


def measured(last: float | None, took: float) -> float:
    """A stage's time to reserve next plan: what it took, or the mean with last time's when that was longer."""
    return took if last is None else max(took, 0.5 * (last + took))
