"""The per-step planner's knobs: :class:`PlannerConfig`, a keyword-only frozen dataclass validated on construction.

Its own module so that what configures the planner (``flexorch plan``, the driver's planner client, benchmarks) reads
apart from the search itself (``solver.planner``, which re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass

from flexorch.solver.backend import DEFAULT_SOLVER, SOLVERS
from flexorch.solver.cost_model import KINDS

__all__ = ["PlannerConfig"]


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
    milliseconds (``solver.fill``), and order the candidate splits by those (False: homogeneous starts only, for
    the planner-quality benchmark's comparison)."""
    tiered_splits: bool = True
    """Offer tiered micro-batch splits too (``solver.microbatching.tiered_split``: sequences far slower than an
    average micro-batch share one)."""
    round_splits: bool = True
    """With ``tiered_splits``: tiered splits that start from the slowest sequences' best micro-batches, as the rounds
    bound places them (``solver.round_bounds.best_round_split``: chains of them in one group where memory allows)."""
    halves: bool = True
    """The search of the slowest sequences' layouts (``solver.halves``): with ``tiered_splits``, more tiered splits
    whose slowest sequences take the groups they run on (one of all N devices, or two of N/2 side by side each running a
    share: the per-degree fronts of ``solver.round_bounds``) where the others take their least degree, and at the fewest
    micro-batches tiered splits whose tiered micro-batches take the shortest sequences where the rest would need one
    more; and the local search splits a slow group in two half-size groups where that is faster. False: none of these
    (the planner-quality benchmark's ``--no-halves``)."""
    stop_at_bound: bool = True
    """Stop searching where the answer is proven within ``tolerance`` of optimal: a micro-batch whose start is within
    it of the micro-batch's lower bound is not solved, and no further split is tried once the best plan is within it
    of the step's bound. On the demo's batches (4 workers, 16 documents) that is most plans: a median 62 ms of planner
    time instead of 273 ms, taken from the workers' cores. False: every micro-batch solved and every split tried while
    time is left (``benchmarks/sim/planner_stop.py`` plans each batch both ways)."""
    hybrid: bool = True
    """With a topology of several nodes (``Planner.plan(topology=...)``): offer hybrid groups where a group spans
    nodes (Ulysses inside each node x ring across them, ``solver.cost_model.hybrid_seq_times_ms``). False: the 1-D
    kinds only (the topology benchmark's comparison)."""
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
