"""The per-step pipeline plan: chunk, order, checkpoint, simulate; choose the granularity (InfiniPipe, Seq1F1B).

For each candidate granularity K (default P, 2P, 4P, 8P units), :func:`plan_pipeline` chunks the batch
(``flexorch.solver.pipeline.chunking``), orders it 1F1B (``flexorch.solver.pipeline.schedule``), picks the checkpointed
layers that fit memory (``flexorch.solver.pipeline.checkpointing``), and simulates it
(``flexorch.solver.pipeline.sim``); it keeps the fastest. When no checkpointing fits one pipeline, the units are run as
back-to-back pipelines (split between sequences, each pipeline drains
before the next starts), as InfiniPipe does. The baselines of the benchmark go through the same code:
:func:`packed_1f1b_units` (plain 1F1B over packed micro-batches, no splitting) and :func:`seq1f1b_units` (every
sequence split into a fixed k segments).
"""

from __future__ import annotations

from dataclasses import dataclass

from flexorch.solver.pipeline.checkpointing import checkpoint_plan, fits, held_sets
from flexorch.solver.pipeline.chunking import Piece, Unit, chunk_batch
from flexorch.solver.pipeline.schedule import Op, one_f_one_b
from flexorch.solver.pipeline.segments import equal_flop_boundaries, segment_cost
from flexorch.solver.pipeline.sim import PipelineRun, simulate
from flexorch.solver.pipeline.stage_model import StageModel
from flexorch.solver.profiles import Profile

__all__ = [
    "Pipeline",
    "PipelinePlan",
    "pipeline_layouts",
    "plan_best_layout",
    "plan_pipeline",
    "plan_units",
    "plan_fully_checkpointed",
    "packed_1f1b_units",
    "seq1f1b_units",
]


@dataclass(frozen=True)
class Pipeline:
    units: tuple[Unit, ...]
    schedule: tuple[tuple[Op, ...], ...]
    checkpointed: tuple[tuple[int, ...], ...]
    """Layers checkpointed ``[stage][unit]``."""
    run: PipelineRun


@dataclass(frozen=True)
class PipelinePlan:
    stages: int
    granularity: int
    pipelines: tuple[Pipeline, ...]
    """Run one after another (more than one only when memory requires)."""

    @property
    def makespan_ms(self) -> float:
        return sum(p.run.makespan_ms for p in self.pipelines)

    @property
    def bubble_share(self) -> float:
        busy = sum(sum(p.run.busy_ms) for p in self.pipelines)
        return 1.0 - busy / (self.stages * self.makespan_ms) if self.makespan_ms > 0 else 0.0

    @property
    def peak_bytes(self) -> tuple[float, ...]:
        return tuple(max(p.run.peak_bytes[r] for p in self.pipelines) for r in range(self.stages))

    @property
    def units(self) -> list[Unit]:
        return [u for p in self.pipelines for u in p.units]


def _simulated(model: StageModel, units: list[Unit], sched, ckpt) -> Pipeline:
    """``units`` run in the order ``sched`` with ``ckpt[stage][unit]`` layers checkpointed, simulated on ``model``."""
    p = model.stages
    run = simulate(
        sched,
        [[model.fwd_ms(u, r) for u in units] for r in range(p)],
        [[model.bwd_ms(u, r, ckpt[r][i]) for i, u in enumerate(units)] for r in range(p)],
        [[model.act_bytes(u, r, ckpt[r][i]) for i, u in enumerate(units)] for r in range(p)],
        p2p_ms=[model.send_ms(u) for u in units],
    )
    return Pipeline(tuple(units), tuple(tuple(s) for s in sched), tuple(tuple(c) for c in ckpt), run)


def _one_pipeline(model: StageModel, units: list[Unit], time_limit_s: float) -> Pipeline | None:
    sched = one_f_one_b(units, model.stages)
    ckpt = checkpoint_plan(model, units, sched, time_limit_s)
    return None if ckpt is None else _simulated(model, units, sched, ckpt)


def _split_between_chains(units: list[Unit], parts: int) -> list[list[Unit]]:
    """``parts`` consecutive runs of whole chains with similar work."""
    chains: list[list[Unit]] = []
    for u in units:
        if chains and chains[-1][-1].chain == u.chain:
            chains[-1].append(u)
        else:
            chains.append([u])
    if parts > len(chains):
        return []
    total = sum(u.work for u in units)
    out: list[list[Unit]] = [[]]
    acc = 0.0
    for i, ch in enumerate(chains):
        left_chains, left_parts = len(chains) - i, parts - len(out)
        if out[-1] and (acc >= total * len(out) / parts or left_chains == left_parts):
            out.append([])
        out[-1].extend(ch)
        acc += sum(u.work for u in ch)
    return out


def _renumber(units: list[Unit]) -> list[Unit]:
    first = {}
    return [Unit(u.pieces, first.setdefault(u.chain, len(first)), u.position, u.work) for u in units]


def _fits_most_checkpointed(model: StageModel, units: list[Unit]) -> bool:
    return fits(model, units, one_f_one_b(units, model.stages), model.most_checkpointed(len(units)))


def _split_that_fits(model: StageModel, units: list[Unit]) -> list[list[Unit]] | None:
    """The fewest back-to-back pipelines (split between sequences) that fit with the most layers checkpointed that
    ``model.recompute`` allows (every layer but under 'none'): the count is found by doubling, then bisection (fewer
    units in flight per pipeline never need more memory)."""

    tried: dict[int, list[list[Unit]] | None] = {}

    def groups(parts: int) -> list[list[Unit]] | None:
        if parts not in tried:
            gs = [units] if parts == 1 else _split_between_chains(units, parts)
            gs = [_renumber(g) for g in gs]
            tried[parts] = gs if gs and all(_fits_most_checkpointed(model, g) for g in gs) else None
        return tried[parts]

    chains = len({u.chain for u in units})
    lo, hi = 0, 1  # lo: known not to fit (0: none tried), hi: candidate
    while groups(hi) is None:
        if hi >= chains:
            return None
        lo, hi = hi, min(2 * hi, chains)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if groups(mid) is None:
            lo = mid
        else:
            hi = mid
    return groups(hi)


def _too_big(model: StageModel, units: list[Unit]) -> str:
    """Why even one sequence per pipeline, with the most layers checkpointed ``model.recompute`` allows, does not
    fit."""
    worst = (0.0, 0, 0)
    for chain in sorted({u.chain for u in units}):
        mine = _renumber([u for u in units if u.chain == chain])
        sched = one_f_one_b(mine, model.stages)
        most = model.most_checkpointed(len(mine))
        for r, ops in enumerate(sched):
            for held in held_sets(ops):
                need = sum(model.act_bytes(mine[u], r, most[r][u]) for u in held)
                if need > worst[0]:
                    worst = (need, r, sum(u.tokens for u in mine))
    need, r, tokens = worst
    if model.recompute == "none":
        head = "with [sharding] activation_checkpointing = 'none' (no layer recomputed)"
        fix = "set activation_checkpointing = 'auto' (stages recompute layers where memory needs it), add "
    else:
        head = "no activation checkpointing fits the memory budget: even with every layer checkpointed"
        fix = "add "
    return (
        f"{head} and each sequence in a pipeline of its own, stage {r} must hold {_size(need)} at once for a unit "
        f"chain of {tokens} tokens (a sequence keeps all its segments until its backward), the budget is "
        f"{_size(model.budget_bytes(r))}; {fix}stages or workers per stage, raise the memory budget "
        "(plan.tokens_per_worker), or lower the context length"
    )


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def plan_units(model: StageModel, units: list[Unit], granularity: int, time_limit_s: float = 2.0) -> PipelinePlan:
    """Plan given units: one pipeline if checkpointing makes it fit, else the fewest back-to-back pipelines."""
    groups = _split_that_fits(model, units)
    if groups is None:
        raise ValueError(_too_big(model, units))
    pipes = [_one_pipeline(model, g, time_limit_s) for g in groups]
    if any(p is None for p in pipes):  # cannot happen: every group fits fully checkpointed
        raise RuntimeError("a back-to-back pipeline that fits fully checkpointed got no checkpoint plan")
    return PipelinePlan(model.stages, granularity, tuple(pipes))


def plan_fully_checkpointed(
    lengths, stages: int, profile: Profile, *, degree: int = 1, recompute: str = "auto"
) -> PipelinePlan:
    """A plan without any MILP (for when the planner is stuck): granularity P, every layer checkpointed (none under
    ``recompute`` 'none'), the fewest back-to-back pipelines that fit. Slower than :func:`plan_pipeline`'s, never
    less safe on memory."""
    model = StageModel(profile, stages, degree, recompute)
    every = StageModel(profile, stages, degree, "none" if recompute == "none" else "full")
    units = chunk_batch(lengths, stages, profile.a1_ms, profile.a2_ms, max(model.token_cap(), 1))
    groups = _split_that_fits(model, units)
    if groups is None:
        raise ValueError(_too_big(model, units))
    pipes = [_simulated(model, g, one_f_one_b(g, stages), every.most_checkpointed(len(g))) for g in groups]
    return PipelinePlan(stages, stages, tuple(pipes))


def plan_pipeline(
    lengths,
    stages: int,
    profile: Profile,
    *,
    degree: int = 1,
    granularities: list[int] | None = None,
    time_limit_s: float = 2.0,
    recompute: str = "auto",
) -> PipelinePlan:
    """The fastest simulated plan of ``lengths`` on ``stages`` stages of ``degree`` workers each, recomputing as
    ``recompute`` says (``StageModel.recompute``)."""
    model = StageModel(profile, stages, degree, recompute)
    cap = model.token_cap()
    if cap < 1:
        raise ValueError(
            f"the memory budget leaves no room for activations on a stage ({model.budget_bytes(0) / 2**30:.2f} GiB "
            "after the model state); add stages or lower the model state"
        )
    cands = granularities or [stages * f for f in (1, 2, 4, 8)]
    best: PipelinePlan | None = None
    for k in sorted(set(cands)):
        units = chunk_batch(lengths, k, profile.a1_ms, profile.a2_ms, cap)
        plan = plan_units(model, units, k, time_limit_s)
        if best is None or plan.makespan_ms < best.makespan_ms:
            best = plan
    return best


def pipeline_layouts(devices: int, num_layers: int, min_stages: int = 2) -> list[tuple[int, int]]:
    """(stages, workers per stage) splits of ``devices`` worth trying: powers of two, at most one stage per layer."""
    out = []
    p = 1
    while p <= devices:
        if devices % p == 0 and min_stages <= p <= num_layers:
            out.append((p, devices // p))
        p *= 2
    return out


def plan_best_layout(
    lengths,
    devices: int,
    profile: Profile,
    *,
    time_limit_s: float = 1.0,
    layouts: list[tuple[int, int]] | None = None,
    recompute: str = "auto",
) -> tuple[PipelinePlan, int, int]:
    """``pipeline_stages = auto``: the fastest simulated plan over ``layouts`` (default :func:`pipeline_layouts`);
    returns it with its (stages, degree). Layouts whose memory no checkpointing can meet are skipped; none fitting
    is an error."""
    best, errors = None, []
    for stages, degree in layouts or pipeline_layouts(devices, profile.num_layers):
        try:
            plan = plan_pipeline(
                lengths, stages, profile, degree=degree, time_limit_s=time_limit_s, recompute=recompute
            )
        except ValueError as e:
            errors.append(f"{stages}x{degree}: {e}")
            continue
        if best is None or plan.makespan_ms < best[0].makespan_ms:
            best = (plan, stages, degree)
    if best is None:
        detail = "; ".join(errors) or f"no layout of {devices} devices has 2 to {profile.num_layers} stages"
        raise ValueError(f"no pipeline layout fits this batch: {detail}")
    return best


def packed_1f1b_units(lengths, micro_batches: int, a1: float, a2: float) -> list[Unit]:
    """Plain 1F1B's units: whole sequences packed into ``micro_batches`` of similar token counts, none split."""
    lengths = [int(s) for s in lengths]
    bins: list[list[int]] = [[] for _ in range(micro_batches)]
    tokens = [0] * micro_batches
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        b = min(range(micro_batches), key=lambda b: tokens[b])
        bins[b].append(i)
        tokens[b] += lengths[i]
    units = []
    for c, seqs in enumerate(b for b in bins if b):
        work = sum(segment_cost(0, lengths[i], a1, a2) for i in seqs)
        units.append(Unit(tuple(Piece(i, 0, lengths[i]) for i in seqs), c, 0, work))
    return units


def seq1f1b_units(lengths, micro_batches: int, k: int, a1: float, a2: float) -> list[Unit]:
    """Seq1F1B's units: plain 1F1B's packed micro-batches, each split into ``k`` segments (segment j of a micro-batch
    holds the j-th equal-work segment of each of its sequences; a micro-batch is one chain)."""
    units = []
    for mb in packed_1f1b_units(lengths, micro_batches, a1, a2):
        per_seq = [(p.seq, equal_flop_boundaries(p.tokens, min(k, p.tokens), a1, a2)) for p in mb.pieces]
        for j in range(k):
            pieces = [Piece(i, xs[j], xs[j + 1]) for i, xs in per_seq if j + 1 < len(xs)]
            work = sum(segment_cost(q.start, q.end, a1, a2) for q in pieces)
            units.append(Unit(tuple(pieces), mb.chain, j, work))
    return units
