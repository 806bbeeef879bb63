"""The 1F1B order of one step's pipeline units on every stage (Seq1F1B, arXiv 2406.03488, §3.2 and Fig. 3).

Every stage runs the units' forwards in the same order (the chunker's order: a split sequence's segments
consecutive, first to last) and their backwards in the same order: sequence by sequence, each sequence's segments
*reversed* (segment j's backward produces the gradient of the K/V that segments < j contributed, so it must run
before theirs). Stage r (0-based, of P) first runs

    warm-up(r) = P - r - 1 + (k - 1)         forwards (Seq1F1B's pp - r + k - 2, k = segments of the first sequence)

then alternates one forward and one backward, and drains the remaining backwards. A backward whose forward has
not run yet on that stage is not taken early: the stage runs its next forward instead. :func:`check_schedule`
verifies the orders; ``flexorch.solver.pipeline.sim`` runs a schedule with dependencies across stages and reports a
deadlock rather than hanging, so an executor that follows a checked, simulated schedule cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexorch.solver.pipeline.chunking import Unit

__all__ = ["Op", "backward_order", "warmup_count", "one_f_one_b", "check_schedule", "ScheduleError"]


class ScheduleError(ValueError):
    """A schedule that breaks an ordering rule (the message names the stage and the ops)."""


@dataclass(frozen=True)
class Op:
    kind: str  # "F" or "B"
    unit: int

    def __str__(self) -> str:
        return f"{self.kind}{self.unit}"


def _chains(units: list[Unit]) -> list[list[int]]:
    """Unit indices per chain, chains in order of their first unit, segments in order."""
    order: dict[int, list[int]] = {}
    for i, u in enumerate(units):
        order.setdefault(u.chain, []).append(i)
    return list(order.values())


def backward_order(units: list[Unit]) -> list[int]:
    """Chains in forward order, each chain's segments reversed."""
    return [i for chain in _chains(units) for i in reversed(chain)]


def warmup_count(stage: int, stages: int, units: list[Unit]) -> int:
    """Forwards stage ``stage`` runs before its first backward (Seq1F1B: P - r + k - 2), at most all units."""
    first_chain = _chains(units)[0] if units else []
    return min(len(units), stages - stage - 1 + max(len(first_chain) - 1, 0))


def one_f_one_b(units: list[Unit], stages: int) -> list[list[Op]]:
    """Per stage, the ordered forward and backward ops of one pipeline over ``units``."""
    if stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got {stages}")
    if not units:
        raise ValueError("a pipeline needs at least one unit")
    n = len(units)
    bwd = backward_order(units)
    schedule = []
    for r in range(stages):
        ops: list[Op] = []
        f = b = 0
        for _ in range(warmup_count(r, stages, units)):
            ops.append(Op("F", f))
            f += 1
        while b < n:
            if f < n:  # one forward ...
                ops.append(Op("F", f))
                f += 1
            while b < n and bwd[b] < f:  # ... then the backwards whose forward has run (one, in steady state)
                ops.append(Op("B", bwd[b]))
                b += 1
                if f < n:
                    break
        schedule.append(ops)
    check_schedule(schedule, units)
    return schedule


def check_schedule(schedule: list[list[Op]], units: list[Unit]) -> None:
    """Raise :class:`ScheduleError` unless every stage runs every unit's forward, then its backward, in orders that
    respect the segments of each sequence and agree across stages."""
    n = len(units)
    chains = _chains(units)
    fwd_ref: list[int] | None = None
    bwd_ref: list[int] | None = None
    for r, ops in enumerate(schedule):
        fwd = [op.unit for op in ops if op.kind == "F"]
        bwd = [op.unit for op in ops if op.kind == "B"]
        if sorted(fwd) != list(range(n)) or sorted(bwd) != list(range(n)):
            raise ScheduleError(f"stage {r}: every unit needs exactly one forward and one backward")
        seen = set()
        for op in ops:
            if op.kind == "B" and op.unit not in seen:
                raise ScheduleError(f"stage {r}: B{op.unit} comes before F{op.unit}")
            if op.kind == "F":
                seen.add(op.unit)
        pos_f = {u: i for i, u in enumerate(fwd)}
        pos_b = {u: i for i, u in enumerate(bwd)}
        for chain in chains:
            for a, b in zip(chain, chain[1:], strict=False):
                if pos_f[a] > pos_f[b]:
                    raise ScheduleError(f"stage {r}: F{b} (a later segment) runs before F{a}")
                if pos_b[b] > pos_b[a]:
                    raise ScheduleError(f"stage {r}: B{a} runs before B{b} (a later segment of the same sequence)")
        if fwd_ref is None:
            fwd_ref, bwd_ref = fwd, bwd
        elif fwd != fwd_ref or bwd != bwd_ref:
            raise ScheduleError(f"stage {r}: its forward or backward order differs from stage 0's")
