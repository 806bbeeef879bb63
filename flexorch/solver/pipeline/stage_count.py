"""Which pipeline stage counts a world of workers can run: the one rule behind `flexorch train`'s config check,
`flexorch plan --pipeline-stages` and the per-step staged plan.

``P`` stages on ``n`` workers put ``d = n // P`` workers on each stage (Ulysses SP inside a stage; the ``n - P*d``
left over sit the step out), so a fixed ``P`` needs ``1 <= P <= layers`` (every stage runs at least one layer),
``P <= n``, and ``d`` dividing the attention heads. ``"auto"`` tries the splits of :func:`auto_stage_layouts`
(powers of two ``2 <= P <= min(n, layers)`` whose ``d`` divides the heads) and needs at least one.
"""

from __future__ import annotations

from flexorch.solver.errors import InfeasibleBatchError, PlanningError

__all__ = ["auto_stage_layouts", "check_stage_count"]


def auto_stage_layouts(workers: int, num_layers: int, num_heads: int) -> list[tuple[int, int]]:
    """The (stages, workers per stage) splits ``"auto"`` chooses from, fewest stages first."""
    out, p = [], 2
    while p <= min(workers, num_layers):
        if num_heads % (workers // p) == 0:
            out.append((p, workers // p))
        p *= 2
    return out


def check_stage_count(
    stages: int | str,
    workers: int,
    num_layers: int,
    num_heads: int,
    *,
    key: str = "pipeline_stages",
    model: str = "the model",
    have: str | None = None,
) -> None:
    """Refuse a stage count that ``workers`` workers cannot run, with the numbers and what to change.

    ``key`` names the setting as the caller's user wrote it (``pipeline_stages``, ``--pipeline-stages``),
    ``model`` whose layers and heads these are (``the model``, ``profile gpt-7b-a100``), ``have`` how many
    workers there are, in the caller's words (default ``there are N``). A stage count that is not a positive
    integer or ``"auto"`` is a :class:`PlanningError`; one the workers cannot run an
    :class:`InfeasibleBatchError` (both ValueErrors)."""
    flag = key.startswith("--")
    sep = " " if flag else " = "
    have = have or f"there are {workers}"
    if stages == "auto":
        if not auto_stage_layouts(workers, num_layers, num_heads):
            auto = "auto" if flag else "'auto'"
            raise InfeasibleBatchError(
                f"{key}{sep}{auto}: no split of {workers} workers into 2 to {num_layers} stages (powers of two, at "
                f"most one per layer) puts a number of workers on each stage that divides {model}'s {num_heads} "
                f"heads; use at least 2 workers and 2 layers, or give a fixed {key}"
            )
        return
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise PlanningError(f"{key} must be a positive integer or 'auto', got {stages!r}")
    if stages > num_layers:
        raise InfeasibleBatchError(
            f"{key}{sep}{stages} is more stages than {model}'s {num_layers} layers: every stage needs at least one "
            f"layer; use at most {num_layers} stages"
        )
    if stages > workers:
        raise InfeasibleBatchError(
            f"{key}{sep}{stages} needs at least {stages} workers, {have}; add workers or lower {key} (or use 'auto')"
        )
    d = workers // stages
    if num_heads % d:
        raise InfeasibleBatchError(
            f"{key}{sep}{stages} on {workers} workers puts {d} workers on each stage (Ulysses SP inside a stage), "
            f"but {model}'s {num_heads} heads are not divisible by {d}; choose {key} so that workers // stages "
            "divides the heads, or 'auto'"
        )
