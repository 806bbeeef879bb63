"""Local search over the discrete allotments that the wavefront scheduler packs (flexorch's, beyond Spindle §4.3).

The bi-point pieces of the continuous allocation ask, at some instants, more devices than N (two tasks each
rounded up to a half of the cluster leave nothing for a third), and the scheduler then delays someone. Here each
MetaOp has a few allotments to choose from: its bi-point pieces at C*(1 + s) for s in ``slacks`` (fewer devices
on average, more room for the rounding), and every single count that makes it faster than the count below (all
layers on one block). Starting from each of the bi-point allotments, the all-devices allotment (tasks in turn)
and the fixed split, one MetaOp's allotment is changed at a time, keeping a change when the scheduled
makespan falls (the best such change each pass), until none does; from every start in turn, until ``max_evals``
distinct schedules were tried in all.

``split_layers=False`` keeps only whole allotments, one count for all of a MetaOp's layers: the bi-point
allotments of two pieces are not offered (one of a single piece is), so every MetaOp becomes exactly one part. The
workers execute such plans today (``execute.py``); running a task's layers on two device sets would need its
activations moved between them mid-model, which is not built.
"""

from __future__ import annotations

import math

from flexorch.solver.multitask.allocation import continuous_allocation
from flexorch.solver.multitask.baselines import fixed_split_counts
from flexorch.solver.multitask.discretise import Piece, bi_point
from flexorch.solver.multitask.waves import schedule

__all__ = ["allotment_options", "search_schedule"]


def allotment_options(
    metaops, num_devices: int, c_star: float, slacks, split_layers: bool = True
) -> list[list[tuple[Piece, ...]]]:
    """Per MetaOp, its distinct allotments (tuples of pieces); the bi-point ones first, by slack. Without
    `split_layers`, only allotments of one piece (all the MetaOp's layers on one count)."""
    options: list[list[tuple[Piece, ...]]] = [[] for _ in metaops]
    for s in slacks:
        pieces = bi_point(metaops, continuous_allocation(metaops, num_devices, c_star * (1 + s)))
        for i, m in enumerate(metaops):
            mine = tuple(p for p in pieces if (p.task, p.level) == (m.task, m.level))
            if (split_layers or len(mine) == 1) and mine not in options[i]:
                options[i].append(mine)
    for i, m in enumerate(metaops):
        prev = math.inf
        for c, t in zip(m.counts, m.layer_ms, strict=True):
            single = (Piece(m.task, m.level, c, m.layers),)
            if t < prev and single not in options[i]:
                options[i].append(single)
            prev = min(prev, t)
    return options


def _makespan(parts) -> float:
    return max(p.end_ms for p in parts)


def search_schedule(metaops, num_devices: int, c_star: float, slacks, max_evals: int = 1500, split_layers: bool = True):
    """(makespan, parts, note) of the best schedule found (whole MetaOps only without `split_layers`)."""
    options = allotment_options(metaops, num_devices, c_star, slacks, split_layers)
    top = 1 << (num_devices.bit_length() - 1)
    starts = {f"bi-point, slack {s:g}": [k] * len(metaops) for k, s in enumerate(slacks)}
    starts = {k: [min(j, len(options[i]) - 1) for i, j in enumerate(v)] for k, v in starts.items()}
    split = fixed_split_counts(metaops, num_devices)
    for name, counts in (("in turn", {m.task: top for m in metaops}), ("fixed split", split)):
        if counts is not None:
            starts[name] = [
                options[i].index((Piece(m.task, m.level, counts[m.task], m.layers),))
                if (Piece(m.task, m.level, counts[m.task], m.layers),) in options[i]
                else 0
                for i, m in enumerate(metaops)
            ]
    cache: dict[tuple, tuple] = {}

    def run(choice) -> tuple:
        key = tuple(choice)
        if key not in cache:
            pieces = tuple(p for i, j in enumerate(choice) for p in options[i][j])
            parts = schedule(metaops, pieces, num_devices)
            cache[key] = (_makespan(parts), parts)
        return cache[key]

    best_name, best = None, None
    for name, start in starts.items():  # a local search from every start
        current = list(start)
        while len(cache) < max_evals:
            trials = [
                current[:i] + [j] + current[i + 1 :]
                for i in range(len(metaops))
                for j in range(len(options[i]))
                if j != current[i]
            ]
            if not trials:  # one allotment per MetaOp (e.g. one device): nothing to change
                break
            trial = min(trials, key=lambda c: run(c)[0] if len(cache) < max_evals or tuple(c) in cache else math.inf)
            if not run(trial)[0] < run(current)[0] * (1 - 1e-9):
                break
            current = trial
        if best is None or run(current)[0] < run(best)[0]:
            best_name, best = name, current
    makespan, parts = run(best)
    return makespan, parts, f"from {best_name}, {len(cache)} schedules tried"
