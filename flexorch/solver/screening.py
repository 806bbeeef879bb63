"""Screening candidate micro-batch splits: each split's static starts (what its MILPs start from), and the order the
planner solves the splits in, cheapest start first.

A start is each micro-batch's best homogeneous layout (``solver.packing``), or with ``fill_starts`` the better of
that and a mixed layout packed in milliseconds (``solver.fill``).
"""

from __future__ import annotations

import time

import numpy as np

from flexorch.solver.fill import fill_draft
from flexorch.solver.planner_config import PlannerConfig
from flexorch.solver.step_tables import StepTables

__all__ = ["fill_starts", "screen_splits"]


def screen_splits(
    step: StepTables, cands, kinds, bounds, mb_bounds, screen_deadline, fill_deadline, *, config: PlannerConfig
) -> tuple[list, set[int]]:
    """Order candidate splits by their static starts (what the MILP starts from), cheapest first.

    Bounds alone mislead: a micro-batch filled to the last per cent of memory packs only into a few huge groups,
    which no LP bound sees, and the sorted split's micro-batches of equal long sequences leave no devices for
    the next-longest. Screening takes the lowest-bound split of each strategy (`kinds`) first, then the rest, in
    bound order (memory-full splits last), until `screen_deadline`
    (`fill_deadline` with ``fill_starts``); splits it did not reach follow in that order, and a split whose bound
    cannot beat a screened split's start is not screened. Each micro-batch's start is its best homogeneous
    layout, or with ``fill_starts`` (until `fill_deadline`) the better of that and its mixed layout from
    ``solver.fill``.
    Returns ([(candidate index, per-micro-batch static drafts or None)], the candidate indices whose every
    micro-batch ``solver.fill`` packed).
    """
    filled: set[int] = set()
    until = fill_deadline if config.fill_starts else screen_deadline
    done, rest = [], []
    best_est = np.inf
    for ci in _screen_order(cands, kinds, bounds, step.lengths, step.n, step.cap):
        if bounds[ci] >= best_est:  # cannot beat a split already screened: the solve loop skips it too
            rest.append((ci, None))
            continue
        if done and time.monotonic() >= until:
            rest.append((ci, None))
            continue
        starts, whole = _static_starts(step, cands[ci], mb_bounds[ci], fill_deadline, config)
        if whole:
            filled.add(ci)
        est = np.inf if any(s is None for s in starts) else sum(s.makespan() for s in starts)
        best_est = min(best_est, est)
        done.append((est, ci, starts))
    done.sort(key=lambda x: x[0])
    return [(ci, starts) for _, ci, starts in done] + rest, filled


def _screen_order(cands, kinds, bounds, lengths, n, cap: int) -> list[int]:
    """The candidate splits in the order to screen them: the lowest-bound split of each strategy, the informed
    (tiered, rounds) ones first, then the rest; each part in bound order, memory-full splits last."""
    # until screened, a split whose fullest micro-batch is within 10 % of memory is presumed costly
    fill = [max(int(lengths[c].sum()) for c in split) / (n * cap) for split in cands]
    key = [b * (1.0 + 10.0 * max(0.0, f - 0.9)) for b, f in zip(bounds, fill, strict=True)]
    by_key = np.argsort(key, kind="stable").tolist()
    first_of_kind: dict[str, int] = {}
    for ci in by_key:
        first_of_kind.setdefault(kinds[ci], ci)
    # tiered splits exist only where some sequences are far slower than a micro-batch's share: then they are
    # the informed ones (code256 at 1 s: the sorted split, lowest bound, took the time of the better tiered one)
    informed = [ci for kind, ci in first_of_kind.items() if kind.startswith(("tiered", "rounds"))]
    firsts = set(first_of_kind.values())
    lead = sorted(informed, key=by_key.index) + [ci for ci in by_key if ci in firsts and ci not in informed]
    return lead + [ci for ci in by_key if ci not in firsts]


def _static_starts(step: StepTables, split, lower, fill_deadline, config: PlannerConfig):
    """(one split's static starts, True when ``solver.fill`` packed every micro-batch): each micro-batch's best
    homogeneous layout, with ``fill_starts`` (until `fill_deadline`) the better of that and its mixed layout."""
    starts = step.homogeneous_starts(split)
    if config.fill_starts and time.monotonic() < fill_deadline:
        return fill_starts(step, split, lower, starts, fill_deadline, tolerance=config.tolerance)
    return starts, False


def fill_starts(step: StepTables, split, lower, starts, deadline, *, tolerance: float):
    """(the starts of one split, each micro-batch's replaced by its mixed layout from ``solver.fill`` where that
    is faster (or where no homogeneous layout packs it), True when every micro-batch was packed before
    `deadline`). A start within `tolerance` of its bound is kept."""
    tables = step.groups
    new = list(starts)
    for j, (items, start) in enumerate(zip(split, starts, strict=True)):
        if time.monotonic() >= deadline:
            return new, False
        if start is not None and start.makespan() <= lower[j] * (1 + tolerance):
            continue  # already at its bound
        upper = start.makespan() if start is not None else 4.0 * lower[j]
        got = fill_draft(items, tables, lower_ms=lower[j], upper_ms=upper, deadline=deadline)
        if got is not None and (start is None or got.makespan() < start.makespan()):
            new[j] = got
    return new, True
