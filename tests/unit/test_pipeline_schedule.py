"""Pipeline planning pieces (pure): Seq1F1B segments, InfiniPipe chunking, the 1F1B order, the schedule simulator."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from flexorch.solver.pipeline.chunking import Piece, Unit, chunk_batch
from flexorch.solver.pipeline.schedule import (
    Op,
    ScheduleError,
    backward_order,
    check_schedule,
    one_f_one_b,
    warmup_count,
)
from flexorch.solver.pipeline.segments import equal_flop_boundaries, equal_flop_segments, segment_cost
from flexorch.solver.pipeline.sim import simulate
from flexorch.solver.pipeline.stage_model import RECOMPUTE

A1, A2 = 5.128e-6, 0.18396  # gpt-7b-a100 (docs/design.md §2.1)


# ---------------------------------------------------------------- segments
def test_attention_only_boundaries_are_the_square_root_rule():
    assert equal_flop_boundaries(32768, 4, 1.0) == [round(32768 * (i / 4) ** 0.5) for i in range(5)]


def test_reference_split_of_a_32k_sequence():
    # docs/design.md §2.5: 32K, k=4, 7B-like model -> [11554, 8342, 6880, 5992]; that split is equal work for a linear
    # to quadratic ratio a2/a1 of about 40137 tokens
    got = equal_flop_segments(32768, 4, 1.0, 40137.0)
    assert sum(got) == 32768
    assert all(abs(g - w) <= 2 for g, w in zip(got, [11554, 8342, 6880, 5992], strict=True))


@pytest.mark.parametrize("length,k,align", [(32768, 4, 1), (1000, 7, 1), (4096, 8, 16), (97, 3, 1), (5, 5, 1)])
def test_segments_have_equal_work_and_cover_the_sequence(length, k, align):
    xs = equal_flop_boundaries(length, k, A1, A2, align)
    assert xs[0] == 0 and xs[-1] == length and all(b - a >= align for a, b in zip(xs, xs[1:], strict=False))
    assert all(x % align == 0 for x in xs[:-1])
    works = [segment_cost(a, b, A1, A2) for a, b in zip(xs, xs[1:], strict=False)]
    per_token = segment_cost(length - 1, length, A1, A2)  # rounding moves a boundary by < align tokens
    assert max(works) - min(works) <= 2 * align * per_token + 1e-9
    assert sum(works) == pytest.approx(segment_cost(0, length, A1, A2))
    lens = [b - a for a, b in zip(xs, xs[1:], strict=False)]
    if length >= 1000:
        assert lens == sorted(lens, reverse=True)  # later segments attend to more prefix: fewer tokens


@pytest.mark.parametrize(
    "args,message", [((0, 2), "at least one token"), ((10, 0), ">= 1"), ((3, 4), "at most 3 segments")]
)
def test_segment_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        equal_flop_boundaries(*args, A1, A2)


# ---------------------------------------------------------------- chunking
def _long_tail(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.minimum(rng.lognormal(7.0, 1.6, n).astype(int) + 1, 131072)]


@pytest.mark.parametrize("granularity,cap", [(8, 16384), (16, 16384), (32, 8192), (4, 65536)])
def test_chunking_covers_every_token_once_within_the_caps(granularity, cap):
    lengths = _long_tail(96)
    units = chunk_batch(lengths, granularity, A1, A2, cap)
    covered = {i: [] for i in range(len(lengths))}
    for u in units:
        assert u.tokens <= cap
        for p in u.pieces:
            covered[p.seq].append((p.start, p.end))
    for i, spans in covered.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == lengths[i]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)), f"sequence {i} has a gap"
    target = sum(segment_cost(0, s, A1, A2) for s in lengths) / granularity
    for u in units:
        if len(u.pieces) > 1:
            assert u.work <= target * (1 + 1e-9)  # packed units stay under the time target
    # a split sequence's segments are consecutive and in order, longest sequence first
    chains = [u.chain for u in units]
    assert chains == sorted(chains)
    for _, grp in itertools.groupby(units, key=lambda u: u.chain):
        grp = list(grp)
        assert [u.position for u in grp] == list(range(len(grp)))
    split = [u for u in units if u.prefix > 0 or (len(u.pieces) == 1 and u.pieces[0].end < lengths[u.pieces[0].seq])]
    if split:
        first = lengths[units[0].pieces[0].seq]
        assert first == max(lengths[u.pieces[0].seq] for u in split)


def test_chunking_balances_work_better_than_one_unit_per_sequence():
    lengths = _long_tail(64, seed=3)
    units = chunk_batch(lengths, 16, A1, A2, 16384)
    work = np.array([u.work for u in units])
    per_seq = np.array([segment_cost(0, s, A1, A2) for s in lengths])
    assert work.max() / work.mean() < per_seq.max() / per_seq.mean()
    assert work.max() <= 1.5 * work.sum() / 16  # no unit is far over the target


@pytest.mark.parametrize(
    "lengths,message",
    [([], "empty batch"), ([10, 0], "sequence 1 is empty"), ([10], "granularity must be >= 1")],
)
def test_chunking_bad_input(lengths, message):
    with pytest.raises(ValueError, match=message):
        chunk_batch(lengths, 0 if lengths == [10] else 4, A1, A2, 1024)


# ---------------------------------------------------------------- 1F1B order
def _units(chain_sizes: list[int]) -> list[Unit]:
    out = []
    for c, k in enumerate(chain_sizes):
        for j in range(k):
            out.append(Unit((Piece(c, 100 * j, 100 * (j + 1)),), c, j, 1.0))
    return out


def test_plain_1f1b_matches_the_textbook_order():
    sched = one_f_one_b(_units([1] * 6), 4)
    assert " ".join(map(str, sched[0])) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert " ".join(map(str, sched[3])) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"


@pytest.mark.parametrize("stages,k", [(4, 4), (2, 3), (8, 2)])
def test_seq1f1b_warmup_counts(stages, k):
    units = _units([k] * 5)
    sched = one_f_one_b(units, stages)
    for r, ops in enumerate(sched):
        warm = next(i for i, op in enumerate(ops) if op.kind == "B")
        assert warm == warmup_count(r, stages, units) + 1 == stages - r + k - 2 + 1  # the steady F precedes B
        assert ops[warm] == Op("B", k - 1)  # the first backward is the first sequence's last segment


def test_backward_runs_segments_in_reverse():
    units = _units([3, 1, 2])
    assert backward_order(units) == [2, 1, 0, 3, 5, 4]


@pytest.mark.parametrize("seed", range(30))
def test_random_schedules_are_valid_and_never_deadlock(seed):
    rng = np.random.default_rng(seed)
    units = _units([int(k) for k in rng.integers(1, 6, rng.integers(1, 12))])
    stages = int(rng.integers(1, 9))
    sched = one_f_one_b(units, stages)
    check_schedule(sched, units)
    t = [[float(rng.uniform(0.5, 2.0)) for _ in units] for _ in range(stages)]
    run = simulate(sched, t, [[2 * x for x in row] for row in t], [[1.0] * len(units)] * stages, p2p_ms=0.1)
    # every op ran after what it needs
    end = {(o.op.kind, o.stage, o.op.unit): o.end_ms for o in run.timings}
    for o in run.timings:
        if o.op.kind == "F" and o.stage > 0:
            assert o.start_ms >= end[("F", o.stage - 1, o.op.unit)] + 0.1 - 1e-9
        if o.op.kind == "B":
            assert o.start_ms >= end[("F", o.stage, o.op.unit)] - 1e-9
            if o.stage < stages - 1:
                assert o.start_ms >= end[("B", o.stage + 1, o.op.unit)] + 0.1 - 1e-9
    assert 0 <= run.bubble_share < 1


def test_bad_schedules_are_refused():
    units = _units([1, 1])
    with pytest.raises(ScheduleError, match="B0 comes before F0"):
        check_schedule([[Op("B", 0), Op("F", 0), Op("F", 1), Op("B", 1)]], units)
    chain = _units([2])
    with pytest.raises(ScheduleError, match="B0 runs before B1"):
        check_schedule([[Op("F", 0), Op("F", 1), Op("B", 0), Op("B", 1)]], chain)
    # orders valid on each stage, but stage 1 waits for F1 while stage 0 waits for B0 from stage 1
    dead = [[Op("F", 0), Op("B", 0), Op("F", 1), Op("B", 1)], [Op("F", 0), Op("F", 1), Op("B", 0), Op("B", 1)]]
    with pytest.raises(ScheduleError, match="deadlocks: stage 0 at B0, stage 1 at F1"):
        simulate(dead, [[1, 1]] * 2, [[1, 1]] * 2, [[1, 1]] * 2)


def test_simulated_1f1b_bubble_matches_the_formula():
    # uniform units, no p2p cost: 1F1B's bubble is (P-1)/(m+P-1) with backward = 2x forward
    p, m = 4, 12
    sched = one_f_one_b(_units([1] * m), p)
    run = simulate(sched, [[1.0] * m] * p, [[2.0] * m] * p, [[1.0] * m] * p)
    assert run.makespan_ms == pytest.approx(3.0 * (m + p - 1))
    assert run.bubble_share == pytest.approx((p - 1) / (m + p - 1))
    assert run.peak_bytes == (4.0, 3.0, 2.0, 1.0)  # stage r holds P - r units at once


# ---------------------------------------------------------------- stage model, checkpointing ILP, the plan
def _profile(budget_gib: float = 26.0, layers: int = 40):
    from flexorch.solver.profiles import get_profile

    p = get_profile("gpt-13b-a100")
    return p.with_overrides(memory_budget_bytes=budget_gib * 2**30, num_layers=layers)


def test_more_stages_than_layers_is_a_clear_error():
    from flexorch.solver.pipeline.plan import plan_pipeline

    with pytest.raises(ValueError, match="8 pipeline stages for a model of 4 layers.*at most 4 stages"):
        plan_pipeline([1000, 2000], 8, _profile(layers=4))


def test_a_budget_no_checkpointing_can_meet_is_a_clear_error():
    from flexorch.solver.pipeline.plan import plan_units
    from flexorch.solver.pipeline.stage_model import StageModel

    model = StageModel(_profile(budget_gib=26.0), 4, 1)
    units = chunk_batch([400_000], 1, A1, A2, 10**9)  # one unit of 400K tokens on one worker per stage
    with pytest.raises(ValueError, match="no activation checkpointing fits the memory budget: even with every layer"):
        plan_units(model, units, 1)


def test_checkpointing_fits_memory_with_variables_tied_along_diagonals():
    from flexorch.solver.pipeline.checkpointing import checkpoint_plan, held_sets
    from flexorch.solver.pipeline.stage_model import StageModel

    model = StageModel(_profile(budget_gib=26.0), 4, 8)
    units = chunk_batch(_long_tail(128, seed=1), 32, model.profile.a1_ms, model.profile.a2_ms, model.token_cap())
    sched = one_f_one_b(units, 4)
    loose = checkpoint_plan(StageModel(_profile(budget_gib=400.0), 4, 8), units, sched)
    assert loose == [[0] * len(units)] * 4  # nothing to checkpoint when everything fits
    ckpt = checkpoint_plan(model, units, sched)
    assert ckpt is not None and sum(map(sum, ckpt)) > 0
    for r in range(4):
        for held in held_sets(sched[r]):
            assert sum(model.act_bytes(units[u], r, ckpt[r][u]) for u in held) <= model.budget_bytes(r) * (1 + 1e-9)
    # the diagonal: stage r, unit u and stage r+1, unit u+1 share a variable
    assert all(ckpt[r][u] == ckpt[r + 1][u + 1] for r in range(3) for u in range(len(units) - 1))


def test_plan_fits_memory_covers_every_token_and_beats_plain_1f1b():
    from flexorch.solver.pipeline.plan import packed_1f1b_units, plan_pipeline, plan_units
    from flexorch.solver.pipeline.stage_model import StageModel

    profile = _profile()
    lengths = _long_tail(256, seed=0)
    plan = plan_pipeline(lengths, 4, profile, degree=8)
    model = StageModel(profile, 4, 8)
    assert all(p <= model.budget_bytes(r) * (1 + 1e-9) for r, p in enumerate(plan.peak_bytes))
    covered = sorted((p.seq, p.start, p.end) for u in plan.units for p in u.pieces)
    tokens = {}
    for seq, a, b in covered:
        assert tokens.get(seq, 0) == a
        tokens[seq] = b
    assert tokens == dict(enumerate(lengths))
    plain = plan_units(model, packed_1f1b_units(lengths, 16, profile.a1_ms, profile.a2_ms), 16)
    assert plan.makespan_ms < plain.makespan_ms and 0 < plan.bubble_share < plain.bubble_share


def test_back_to_back_pipelines_when_one_does_not_fit():
    from flexorch.solver.pipeline.plan import _fits_most_checkpointed, _renumber, _split_between_chains, plan_units
    from flexorch.solver.pipeline.stage_model import StageModel

    # 16 stages: stage 0 holds 16 units at once; at the token cap, even fully checkpointed (each layer keeps its
    # input and K/V, ~30 % of its activations) that is over the budget: the fewest back-to-back pipelines that fit
    model = StageModel(_profile(budget_gib=3.0, layers=32), 16, 2)
    cap = model.token_cap()
    units = chunk_batch([cap] * 16, 16, model.profile.a1_ms, model.profile.a2_ms, cap)
    plan = plan_units(model, units, 16)
    k = len(plan.pipelines)
    assert k >= 2 and len(plan.units) == 16
    assert all(p <= model.budget_bytes(r) * (1 + 1e-9) for r, p in enumerate(plan.peak_bytes))
    fewer = [_renumber(g) for g in _split_between_chains(units, k - 1)]
    assert not all(_fits_most_checkpointed(model, g) for g in fewer), "one pipeline fewer would also have fit"


def test_schedule_picture_has_one_box_per_op_and_a_shared_time_axis():
    import xml.etree.ElementTree as ET

    from flexorch.dashboards.pipeline_svg import render_pipelines_svg
    from flexorch.solver.pipeline.plan import plan_units, seq1f1b_units
    from flexorch.solver.pipeline.stage_model import StageModel

    model = StageModel(_profile(), 4, 8)
    lengths = _long_tail(64, seed=2)
    a = plan_units(model, chunk_batch(lengths, 16, model.profile.a1_ms, model.profile.a2_ms, model.token_cap()), 16)
    b = plan_units(model, seq1f1b_units(lengths, 8, 4, model.profile.a1_ms, model.profile.a2_ms), 0)
    svg = render_pipelines_svg([("elastic", a), ("seq1f1b", b)], width=800)
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    ops = [r for r in root.iter(f"{ns}rect") if r.find(f"{ns}title") is not None]
    assert len(ops) == 2 * 4 * (len(a.units) + len(b.units))  # a forward and a backward per unit per stage
    right = max(float(r.get("x")) + float(r.get("width")) for r in ops)
    assert right == pytest.approx(70 + 800, abs=1.0)  # the longer schedule spans the whole width
    titles = [t.text for t in root.iter(f"{ns}text")]
    assert any(t.startswith("elastic") for t in titles) and any("bubble" in t for t in titles)
    with pytest.raises(ValueError, match="nothing to draw"):
        render_pipelines_svg([])


@pytest.mark.slow
def test_auto_layout_picks_the_fastest_simulated_split():
    from flexorch.solver.pipeline.plan import pipeline_layouts, plan_best_layout, plan_pipeline

    assert pipeline_layouts(32, 40) == [(2, 16), (4, 8), (8, 4), (16, 2), (32, 1)]
    assert pipeline_layouts(8, 4) == [(2, 4), (4, 2)]
    profile = _profile()
    lengths = _long_tail(48, seed=4)
    plan, stages, degree = plan_best_layout(lengths, 8, profile, time_limit_s=0.2)
    assert stages * degree == 8 and plan.stages == stages
    for p, d in pipeline_layouts(8, profile.num_layers):
        assert plan.makespan_ms <= plan_pipeline(lengths, p, profile, degree=d, time_limit_s=0.2).makespan_ms + 1e-6
    with pytest.raises(ValueError, match="no pipeline layout fits this batch"):
        plan_best_layout([2_000_000], 4, _profile(budget_gib=1.0), time_limit_s=0.2)


def _peaks_fit(plan, model) -> bool:
    return all(p <= model.budget_bytes(r) * (1 + 1e-9) for r, p in enumerate(plan.peak_bytes))


def test_stages_recompute_no_layer_or_every_layer_when_told_and_the_fewest_that_fit_on_auto():
    # [sharding] activation_checkpointing with stages: 'auto' the ILP's fewest layers that fit, 'none' no layer
    # (more back-to-back pipelines where memory needs it), 'full' every layer of every unit
    from flexorch.solver.pipeline.plan import plan_fully_checkpointed, plan_pipeline
    from flexorch.solver.pipeline.stage_model import StageModel

    profile = _profile(budget_gib=26.0)
    lengths = _long_tail(128, seed=1)
    plans = {m: plan_pipeline(lengths, 4, profile, degree=8, time_limit_s=0.5, recompute=m) for m in RECOMPUTE}
    layers = StageModel(profile, 4, 8).layers
    for mode, plan in plans.items():
        assert _peaks_fit(plan, StageModel(profile, 4, 8, mode)), mode
        assert sorted((p.seq, p.start, p.end) for u in plan.units for p in u.pieces)[-1][0] == len(lengths) - 1
    ckpt = {m: [c for pipe in p.pipelines for r, row in enumerate(pipe.checkpointed) for c in row] for m, p in
            plans.items()}  # fmt: skip
    assert set(ckpt["none"]) == {0}
    assert all(row == (layers[r],) * len(row) for pipe in plans["full"].pipelines for r, row in
               enumerate(pipe.checkpointed))  # fmt: skip
    assert 0 < sum(ckpt["auto"]) < sum(ckpt["full"])  # this budget needs some recompute, not all
    # with no recompute the same memory holds fewer units at once: more pipelines back to back, or more units
    assert len(plans["none"].pipelines) > len(plans["auto"].pipelines) or plans["none"].granularity != plans[
        "auto"].granularity or len(plans["none"].units) != len(plans["auto"].units)  # fmt: skip
    # recomputing every layer costs time the ILP does not spend
    assert plans["auto"].makespan_ms < plans["full"].makespan_ms
    # the stuck planner's fallback: every layer, or under 'none' no layer
    fb_none = plan_fully_checkpointed(lengths, 4, profile, degree=8, recompute="none")
    assert {c for pipe in fb_none.pipelines for row in pipe.checkpointed for c in row} == {0}
    assert _peaks_fit(fb_none, StageModel(profile, 4, 8, "none"))
    fb = plan_fully_checkpointed(lengths, 4, profile, degree=8)
    assert all(row == (layers[r],) * len(row) for pipe in fb.pipelines for r, row in enumerate(pipe.checkpointed))


def test_a_document_that_needs_recompute_on_stages_set_to_none_is_refused_with_what_to_do():
    from flexorch.solver.pipeline.plan import plan_pipeline

    profile = _profile(budget_gib=26.0)
    long = [400_000]  # fits one worker per stage only with its layers recomputed (the unit cap splits it)
    plan_pipeline(long, 4, profile, degree=8, time_limit_s=0.5)
    with pytest.raises(ValueError, match="with .sharding. activation_checkpointing = 'none' .no layer recomputed.*"
                       "set activation_checkpointing = 'auto'"):  # fmt: skip
        plan_pipeline(long, 4, profile, degree=8, time_limit_s=0.5, recompute="none")
    with pytest.raises(ValueError, match="pipeline recompute 'selective'"):
        plan_pipeline(long, 4, profile, degree=8, recompute="selective")
