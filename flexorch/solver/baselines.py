"""Baselines beside the planner, with the same cost model, the same packer and the same batch.

* `static-ulysses-<d>`: DeepSpeed-Ulysses style, every group has degree d (floor(N/d) groups), Ulysses attention;
* `static-ring-<d>`: Megatron context-parallel style, every group degree d with (zigzag) ring attention;
* `batchada`: FlexSP's 'BatchAda', the best homogeneous layout chosen per batch (over both kinds and all d).

Each static layout gets the same micro-batch candidates (Sequence Blaster splits) as the planner and keeps its
best, then the same local search, so the comparison measures the choice of groups, not different packers.
"""

from __future__ import annotations

import numpy as np

from flexorch.solver.cost_model import RING, ULYSSES, kind_allowed
from flexorch.solver.errors import PlanningError
from flexorch.solver.microbatching import partition_candidates
from flexorch.solver.packing import GroupType, improve_step, layout_groups, pack, time_table, type_overheads
from flexorch.solver.plan import MicroBatch, Plan
from flexorch.solver.profiles import Profile
from flexorch.solver.simulator import step_time_ms
from flexorch.solver.validation import check_batch, largest_degree

__all__ = ["static_plan", "baseline_plans", "baseline_times_ms"]


def static_plan(
    lengths, num_devices: int, profile: Profile, degree: int, kind: str, extra_micro_batches: int = 4
) -> Plan | None:
    """Every group of `degree` with `kind` attention; None when that layout cannot run the batch."""
    lengths = check_batch(lengths, num_devices, profile)
    if degree > num_devices or degree & (degree - 1) or not kind_allowed(kind, degree, profile):
        return None
    types = [GroupType(degree, ULYSSES if degree == 1 else kind)]
    table = time_table(lengths, types, profile)
    overheads = type_overheads(types, profile)  # b1 + this degree's collective latency
    if not np.isfinite(table).all():
        return None  # some sequence needs a larger group
    ng = num_devices // degree
    cap = profile.group_token_cap(types[0].kind, degree)
    caps = np.full(ng, cap, dtype=np.int64)
    best, best_total = None, np.inf
    for split in partition_candidates(lengths, table[:, 0], ng * cap, extra_micro_batches):
        drafts = [pack(items, [0] * ng, table, lengths, caps, overheads) for items in split]
        if any(d is None for d in drafts):
            continue
        total = sum(d.makespan() for d in drafts)
        if total < best_total:
            best, best_total = drafts, total
    if best is None:
        return None
    improve_step(best, [caps] * len(best), table, lengths, overheads)
    mbs = [MicroBatch(tuple(layout_groups(d, types, range(len(lengths))))) for d in best]
    return Plan.for_profile(
        num_devices=num_devices,
        seq_lengths=lengths,
        micro_batches=mbs,
        profile=profile,
        meta={"planner": f"static-{kind}-{degree}"},
    )


def baseline_plans(lengths, num_devices: int, profile: Profile, extra_micro_batches: int = 4) -> dict:
    """name -> Plan (or None when infeasible) for every static degree/kind, plus 'batchada' (the best of them)."""
    lengths = check_batch(lengths, num_devices, profile)
    out: dict[str, Plan | None] = {}
    d = 1
    while d <= largest_degree(num_devices):
        for kind in (ULYSSES, RING) if d > 1 else (ULYSSES,):
            out[f"static-{kind}-{d}"] = static_plan(lengths, num_devices, profile, d, kind, extra_micro_batches)
        d *= 2
    feasible = {k: v for k, v in out.items() if v is not None}
    if not feasible:
        raise PlanningError("no static layout can run this batch")  # check_batch makes this unreachable
    best = min(feasible, key=lambda k: step_time_ms(feasible[k], profile))
    out["batchada"] = feasible[best]
    return out


def baseline_times_ms(lengths, num_devices: int, profile: Profile, extra_micro_batches: int = 4) -> dict:
    """name -> simulated step time in ms (None when that layout cannot run the batch)."""
    return {
        k: (None if p is None else step_time_ms(p, profile))
        for k, p in baseline_plans(lengths, num_devices, profile, extra_micro_batches).items()
    }
