"""How many layers of each unit to checkpoint on each stage: InfiniPipe's stage-aware ILP (arXiv 2509.21275, §5).

A stage holds the activations of the units it has run forward but not yet backward. In a 1F1B pipeline the same
unit reaches stage r one diagonal step later than stage r-1, so InfiniPipe ties the decisions along pipeline
diagonals: unit u on stage r uses variable ``z[u + (P - 1 - r)]``, n + P - 1 integer variables (checkpointed layers,
0..min layers per stage) instead of n * P. For every stage and every moment right after a forward (the peaks), the
held units must fit the stage budget:

    sum_{u held} tokens_u * (act * (l_r - z) + keep * z)  <=  budget_r

and the objective is the recomputation time, sum over stages and units of z * (forward time of one layer of u). It
is solved with python-mip (CBC). :func:`checkpoint_plan` returns the layers per stage and unit, or None when even
checkpointing every layer of every unit does not fit (the planner then splits the step into back-to-back pipelines).
With ``[sharding] activation_checkpointing = "none"`` or ``"full"`` (``StageModel.recompute``) there is no choice:
no layer, or every layer, is checkpointed.
"""

from __future__ import annotations

import mip

from flexorch.solver.pipeline.chunking import Unit
from flexorch.solver.pipeline.schedule import Op
from flexorch.solver.pipeline.stage_model import StageModel

__all__ = ["held_sets", "fits", "checkpoint_plan"]


def held_sets(ops: list[Op]) -> list[list[int]]:
    """The units a stage holds right after each of its forwards (its memory peaks)."""
    held: list[int] = []
    out = []
    for op in ops:
        if op.kind == "F":
            held.append(op.unit)
            out.append(list(held))
        else:
            held.remove(op.unit)
    return out


def fits(model: StageModel, units: list[Unit], schedule: list[list[Op]], ckpt) -> bool:
    """Whether every stage's held activations stay within its budget with ``ckpt[stage][unit]`` layers checkpointed."""
    for r, ops in enumerate(schedule):
        for held in held_sets(ops):
            if sum(model.act_bytes(units[u], r, ckpt[r][u]) for u in held) > model.budget_bytes(r) * (1 + 1e-9):
                return False
    return True


def checkpoint_plan(
    model: StageModel, units: list[Unit], schedule: list[list[Op]], time_limit_s: float = 2.0
) -> list[list[int]] | None:
    """Checkpointed layers ``[stage][unit]`` with the least recomputation that fits memory; None if none fits. Under
    ``model.recompute`` 'none' that is no layer or None, under 'full' every layer or None."""
    p, n = model.stages, len(units)
    if model.recompute != "auto":  # one choice: it fits or not
        only = model.most_checkpointed(n)
        return only if fits(model, units, schedule, only) else None
    none = [[0] * n for _ in range(p)]
    if fits(model, units, schedule, none):
        return none
    top = min(model.layers)
    full = model.most_checkpointed(n)
    if not fits(model, units, schedule, full):
        return None
    m = mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC)
    m.verbose = 0
    m.threads = 1
    z = [m.add_var(var_type=mip.INTEGER, lb=0, ub=top) for _ in range(n + p - 1)]

    def var(r: int, u: int):
        return z[u + (p - 1 - r)]

    for r, ops in enumerate(schedule):
        for held in held_sets(ops):
            fixed = sum(model.act_bytes(units[u], r, 0) for u in held)
            saved = [model.layer_bytes(units[u]) - model.keep_bytes(units[u]) for u in held]
            m += fixed - mip.xsum(s * var(r, u) for s, u in zip(saved, held, strict=True)) <= model.budget_bytes(r)
    m.objective = mip.xsum(
        (model.fwd_ms(units[u], r) / model.layers[r]) * var(r, u) for r in range(p) for u in range(n)
    )
    status = m.optimize(max_seconds=time_limit_s)
    if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
        return full  # fits (checked above) even if CBC found nothing better in time
    ckpt = [[int(round(var(r, u).x)) for u in range(n)] for r in range(p)]
    return ckpt if fits(model, units, schedule, ckpt) else full
