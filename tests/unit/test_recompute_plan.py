"""'auto' recompute in the planner (``flexorch.solver.recompute``): each group's mode from the memory budget, the
time model that prices each group in its mode, the two packings the planner compares, the refit's view of them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flexorch.solver.errors import ProfileError
from flexorch.solver.plan import Group, MicroBatch, Plan
from flexorch.solver.planner import PlannerConfig
from flexorch.solver.recompute import (
    choose_modes,
    choose_packing,
    describe,
    none_bytes_profile,
    recompute_modes,
    too_long_without_recompute,
    with_modes,
)
from flexorch.solver.record_samples import samples_of_record, step_of_record
from flexorch.solver.simulator import group_timings, step_time_ms
from flexorch.solver.step_planner import StepPlanner, heuristic_plan, planner_profile
from tests.solver_helpers import TINY

BASE = planner_profile(
    TINY.with_overrides(hidden=64, act_bytes_per_token=2560.0, a2a_latency_ms={2: 5.0, 4: 9.0}),
    num_heads=4,
    num_kv_heads=2,
    tokens_per_worker=256,
)


DECIDE_S = 4.0
"""Planning time of the tests that check which packing wins: enough for every packing's MILP on a loaded CI machine
(a 0.5 s budget there left one packing to its fallback and the other won; the planner returns once it is done)."""


def G(ranks, seq_ids, kind):
    return Group(len(ranks), kind, tuple(ranks), tuple(seq_ids))


def _auto(act_ratio=4.0, time_ratio=0.75, **kw):
    return BASE.with_overrides(none_act_ratio=act_ratio, none_time_ratio=time_ratio, **kw)


def _plan(profile, micro_batches, lengths, n=4):
    return Plan.for_profile(num_devices=n, seq_lengths=lengths, micro_batches=micro_batches, profile=profile)


def test_each_group_runs_without_recompute_exactly_when_its_shard_fits_the_budget():
    p = _auto(act_ratio=4.0)
    room = p.memory_budget_bytes - p.model_state_bytes
    fits_alone = int(room // (4.0 * p.act_bytes_per_token))  # one device, no all-to-all copies
    lengths = [fits_alone, fits_alone + 1, 2 * fits_alone, 40]
    plan = _plan(
        p,
        [
            MicroBatch((G((0,), (0,), "ulysses"), G((1,), (1,), "ulysses"), G((2, 3), (3,), "ring"))),
            MicroBatch((G((0, 1), (2,), "ring"),)),
        ],
        lengths,
    )
    modes = choose_modes(plan, p)
    # a ring group of 2 holds ceil(tokens / 2) per device, with no copies
    assert modes == (("none", "full", "none"), ("none",))
    copies = p.act_bytes_per_local_token("ulysses", 2) - p.act_bytes_per_token
    ulysses = _plan(p, [MicroBatch((G((0, 1), (0,), "ulysses"),))], [2 * fits_alone])
    want = "none" if fits_alone * (4.0 * p.act_bytes_per_token + copies) <= room else "full"
    assert choose_modes(ulysses, p) == ((want,),) and want == "full"  # the copies tip it over


def test_selective_recompute_runs_where_no_recompute_does_not_fit_and_selective_does():
    # flexorch's decoder can recompute only its MLPs: between the two in bytes and in time
    p = _auto(act_ratio=4.0, time_ratio=0.75).with_overrides(selective_act_ratio=2.0, selective_time_ratio=0.9)
    room = p.memory_budget_bytes - p.model_state_bytes
    none_cap = int(room // (4.0 * p.act_bytes_per_token))
    sel_cap = int(room // (2.0 * p.act_bytes_per_token))
    lengths = [none_cap, none_cap + 1, sel_cap + 1]
    mbs = [MicroBatch((G((0,), (0,), "ulysses"), G((1,), (1,), "ulysses"), G((2,), (2,), "ulysses")))]
    plan = _plan(p, mbs, lengths, n=3)
    assert choose_modes(plan, p) == (("none", "selective", "full"),)
    # where selective measured faster than no recompute (it should not, but a measurement decides), it is chosen
    odd = p.with_overrides(selective_time_ratio=0.7)
    assert choose_modes(plan, odd) == (("selective", "selective", "full"),)
    assert choose_modes(plan, p.with_overrides(selective_act_ratio=0.0)) == (("none", "full", "full"),)
    times = [t.time_ms for t in group_timings(plan, BASE)]
    with_modes(plan, choose_modes(plan, p))
    assert step_time_ms(plan, p) == pytest.approx(max(0.75 * times[0], 0.9 * times[1], times[2]))
    assert describe(plan.meta["recompute"]) == "recompute: none in 1, selective in 1 of 3 groups"


@pytest.mark.parametrize("seed", range(3))
def test_a_step_packed_for_selective_recompute_s_bytes_when_that_is_fastest(seed):
    # no recompute keeps 8x full's bytes (SP over slow links for most documents), selective 1.3x at 0.6 of the time
    p = _auto(act_ratio=8.0, time_ratio=0.55, b1_ms=0.01).with_overrides(
        selective_act_ratio=1.3, selective_time_ratio=0.6
    )
    out = StepPlanner(p, PlannerConfig(time_limit_s=DECIDE_S)).plan(_long_tailed(seed), 4)
    info = _check_chosen(out, p)
    assert set(info) == {"packing", "full_ms", "none_ms", "selective_ms"}
    assert info["packing"] == "selective" and info["selective_ms"] < min(info["full_ms"], info["none_ms"])
    assert "full" not in {m for row in out.plan.meta["recompute"] for m in row}


def test_a_group_without_recompute_is_timed_at_the_measured_share_of_its_full_time():
    p = _auto(time_ratio=0.6)
    lengths = [100, 120, 30]
    plan = _plan(
        p, [MicroBatch((G((0,), (0,), "ulysses"), G((1,), (1,), "ulysses"), G((2,), (2,), "ulysses")))], lengths, n=3
    )
    full = step_time_ms(plan, p)
    mine = [t.time_ms for t in group_timings(plan, p)]
    with_modes(plan, (("none", "full", "none"),))
    assert step_time_ms(plan, p) == pytest.approx(max(0.6 * mine[0], mine[1], 0.6 * mine[2]))
    assert [t.time_ms for t in group_timings(plan, p)] == pytest.approx([0.6 * mine[0], mine[1], 0.6 * mine[2]])
    with_modes(plan, (("none", "none", "none"),))
    assert step_time_ms(plan, p) == pytest.approx(0.6 * full)
    assert step_time_ms(plan, BASE) == pytest.approx(full), "a profile without the ratio times every mode alike"


def _long_tailed(seed, n=24, top=240):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(4.0, 1.0, size=n).astype(int), 8, top).tolist()


def _check_chosen(out, p):
    plan = out.plan
    modes = plan.meta["recompute"]
    info = plan.meta["recompute_packing"]
    assert [len(row) for row in modes] == [len(mb.groups) for mb in plan.micro_batches]
    assert modes == choose_modes(plan, p), "every group runs without recompute exactly where it fits"
    assert out.predicted_ms == pytest.approx(step_time_ms(plan, p)) == pytest.approx(info[f"{info['packing']}_ms"])
    planned = [v for k, v in info.items() if k.endswith("_ms") and v is not None]
    assert out.predicted_ms == pytest.approx(min(planned)), "the fastest packing planned runs"
    assert out.bound_ms <= out.predicted_ms + 1e-9
    return info


@pytest.mark.parametrize("seed", range(3))
def test_many_fixed_costs_per_micro_batch_keep_full_recompute_s_packing(seed):
    # b1 dominates: packing for the bytes without recompute (4x the bytes: about 4x the micro-batches) costs more
    # fixed costs than recompute saves
    p = _auto(act_ratio=4.0, time_ratio=0.9, b1_ms=200.0)
    out = StepPlanner(p, PlannerConfig(time_limit_s=DECIDE_S)).plan(_long_tailed(seed), 4)
    info = _check_chosen(out, p)
    assert info["packing"] == "full" and info["none_ms"] > info["full_ms"]
    assert "full" in {m for row in out.plan.meta["recompute"] for m in row}


@pytest.mark.parametrize("seed", range(3))
def test_cheap_micro_batches_and_a_costly_recompute_pack_for_no_recompute(seed):
    p = _auto(act_ratio=1.5, time_ratio=0.5, b1_ms=0.01)
    out = StepPlanner(p, PlannerConfig(time_limit_s=DECIDE_S)).plan(_long_tailed(seed), 4)
    info = _check_chosen(out, p)
    assert info["packing"] == "none" and info["none_ms"] < info["full_ms"]
    assert {m for row in out.plan.meta["recompute"] for m in row} == {"none"}
    # the plan holds what a device keeps without recompute in every group
    tight = none_bytes_profile(p)
    for mb in out.plan.micro_batches:
        for g in mb.groups:
            tokens = sum(out.plan.seq_lengths[i] for i in g.seq_ids)
            assert math.ceil(tokens / g.degree) <= tight.local_token_cap(g.kind, g.degree)


@pytest.mark.parametrize("seed", range(2))
def test_a_step_of_several_tasks_packs_each_part_for_no_recompute_when_that_is_fastest(seed):
    # the same case for a step of two tasks (Spindle's parts, each an SP plan of its own): each part is packed both
    # ways and runs the faster; packed for full's bytes only, most groups of these parts had to recompute
    p = _auto(act_ratio=1.5, time_ratio=0.5, b1_ms=0.01)
    lengths = _long_tailed(seed)
    task_of = [i % 2 for i in range(len(lengths))]

    def plan(profile):
        out = StepPlanner(profile, PlannerConfig(time_limit_s=DECIDE_S)).plan(
            lengths, 4, task_of=task_of, adapter_ranks=[4, 4]
        )
        return out, with_modes(out.plan, choose_modes(out.plan, p))

    out, chosen = plan(p)
    assert chosen.meta["recompute"] == out.plan.meta["recompute"]
    assert {m for row in out.plan.meta["recompute"] for m in row} == {"none"}
    assert out.predicted_ms == pytest.approx(step_time_ms(out.plan, p))
    tight = none_bytes_profile(p)
    for mb in out.plan.micro_batches:
        for g in mb.groups:
            tokens = sum(out.plan.seq_lengths[i] for i in g.seq_ids)
            assert math.ceil(tokens / g.degree) <= tight.local_token_cap(g.kind, g.degree)
    # planned as before, with full recompute's bytes only (a profile without the modes), then priced the same way
    _, full_only = plan(BASE)
    assert "full" in {m for row in full_only.meta["recompute"] for m in row}
    assert out.predicted_ms < 0.9 * step_time_ms(full_only, p)


def test_a_step_that_fits_without_recompute_everywhere_is_planned_once():
    p = _auto(act_ratio=1.01)
    out = StepPlanner(p, PlannerConfig(time_limit_s=0.3)).plan([40, 60, 30, 20], 4)
    info = _check_chosen(out, p)
    assert info == {"packing": "full", "full_ms": pytest.approx(out.predicted_ms)}  # no other packing planned
    assert {m for row in out.plan.meta["recompute"] for m in row} == {"none"}


def test_documents_too_long_to_run_without_recompute_get_micro_batches_of_their_own():
    # no group of the 4 devices holds a 600-token document without recompute (2x the bytes: 4 x 141 tokens): the
    # none packing runs the two long ones first, packed for full recompute's bytes, then the rest without recompute
    p = _auto(act_ratio=2.0, time_ratio=0.4, b1_ms=0.01)
    lengths = [130, 600, 140, 125, 100, 120, 135, 110, 700, 40, 60, 80]
    assert too_long_without_recompute(lengths, 4, p) == [1, 8]
    out = StepPlanner(p, PlannerConfig(time_limit_s=DECIDE_S)).plan(lengths, 4)
    info = _check_chosen(out, p)
    assert info["packing"] == "none" and info["none_ms"] < info["full_ms"]
    plan, modes = out.plan, out.plan.meta["recompute"]
    docs = [{i for g in mb.groups for i in g.seq_ids} for mb in plan.micro_batches]
    first_short = next(k for k, ids in enumerate(docs) if not ids & {1, 8})
    assert set().union(*docs[:first_short]) == {1, 8}, "the long documents' micro-batches come first, alone"
    assert all(not ids & {1, 8} for ids in docs[first_short:])
    assert all(m == "full" for row in modes[:first_short] for m in row)
    assert all(m == "none" for row in modes[first_short:] for m in row)
    assert out.bound_ms == 0.0 and out.gap is None, "no bound is claimed for a plan that recomputes"
    only_long = StepPlanner(p, PlannerConfig(time_limit_s=0.3)).plan([700, 600], 4)
    assert _check_chosen(only_long, p)["none_ms"] is None  # nothing to pack without recompute


def test_static_layouts_fallbacks_and_task_steps_carry_modes_too():
    p = _auto(act_ratio=4.0, time_ratio=0.7)
    lengths = [10, 200, 40, 256]
    static = StepPlanner(p, PlannerConfig(), static=("ring", 2)).plan(lengths, 4)
    assert static.plan.meta["recompute"] == choose_modes(static.plan, p)
    assert static.predicted_ms == pytest.approx(step_time_ms(static.plan, p))
    fallback = heuristic_plan(p, lengths, 4, None)
    assert fallback.plan.meta["recompute"] == choose_modes(fallback.plan, p)
    tasks = StepPlanner(p, PlannerConfig(time_limit_s=0.5)).plan(lengths, 4, task_of=[0, 1, 0, 1], adapter_ranks=[4, 4])
    assert tasks.plan.meta["recompute"] == choose_modes(tasks.plan, p)
    assert tasks.predicted_ms == pytest.approx(step_time_ms(tasks.plan, p))
    plain = StepPlanner(BASE, PlannerConfig(time_limit_s=0.3)).plan(lengths, 4)
    assert "recompute" not in plain.plan.meta and recompute_modes(plain.plan, BASE) is None
    assert recompute_modes(plain.plan, p) == choose_modes(plain.plan, p), "a plan made without modes gets them"


def test_the_fastest_packing_wins_and_says_what_it_compared():
    p = _auto(time_ratio=0.5)

    def two_micro_batches():
        mbs = [MicroBatch((G((0,), (0,), "ulysses"),)), MicroBatch((G((0,), (1,), "ulysses"),))]
        return _plan(p, mbs, [200, 10], 1)

    def one_micro_batch():
        return _plan(p, [MicroBatch((G((0,), (0, 1), "ulysses"),))], [200, 10], 1)

    a, b = two_micro_batches(), two_micro_batches()
    chosen, info = choose_packing(a, {"none": b}, p)
    assert chosen is a and info.ran == "full" and info.ms["none"] == pytest.approx(info.ms["full"])  # a tie
    chosen, info = choose_packing(a, {"none": None}, p)
    assert info.record() == {"packing": "full", "full_ms": pytest.approx(step_time_ms(a, p)), "none_ms": None}
    assert list(info.record()) == ["packing", "full_ms", "none_ms"]  # the record's key order
    assert chosen.meta["recompute_packing"] == info.record() and info.ran_ms == info.ms["full"]
    c = one_micro_batch()  # one fixed cost fewer, every group in the same mode
    chosen, info = choose_packing(two_micro_batches(), {"none": None, "selective": c}, p)
    assert chosen is c and info.ran == "selective" and info.ran_ms == info.ms["selective"] < info.ms["full"]


def test_profiles_refuse_impossible_ratios():
    with pytest.raises(ProfileError, match="none_act_ratio"):
        BASE.with_overrides(none_act_ratio=0.5)
    with pytest.raises(ProfileError, match="none_time_ratio"):
        BASE.with_overrides(none_time_ratio=1.2)
    with pytest.raises(ProfileError, match="none_time_ratio"):
        BASE.with_overrides(none_time_ratio=0.0)
    with pytest.raises(ProfileError, match="selective_act_ratio"):
        BASE.with_overrides(selective_act_ratio=0.9)
    with pytest.raises(ProfileError, match="selective_time_ratio"):
        BASE.with_overrides(selective_time_ratio=1.5)
    assert _auto().to_json()  # the ratios travel with the profile


def _record(modes):
    # two micro-batches: a degree-1 group and a ring group of 2; then one degree-1 group
    plan = {
        "micro_batches": [
            [
                {"degree": 1, "kind": "ulysses", "ranks": [0], "seq_ids": [0], "seq_lengths": [100]},
                {"degree": 2, "kind": "ring", "ranks": [1, 2], "seq_ids": [1], "seq_lengths": [300]},
            ],
            [{"degree": 1, "kind": "ulysses", "ranks": [0], "seq_ids": [2], "seq_lengths": [50]}],
        ]
    }
    ranks = [{"micro_batch_ms": [30.0, 12.0]}, {"micro_batch_ms": [60.0, None]}, {"micro_batch_ms": [62.0, None]}]
    rec = {"source": "train", "pipeline": None, "plan": plan, "ranks": ranks, "compute_ms": 80.0, "measured_ms": 85.0}
    if modes is not None:
        rec["recompute"] = modes
    return rec


def test_the_refit_counts_a_group_run_without_recompute_at_full_recompute_s_time():
    rec = _record([["none", "full"], ["selective"]])
    ratios = {"none": 0.75, "selective": 0.9, "full": 1.0}
    got = samples_of_record(rec, ratios)
    assert [s.ms for s in got] == pytest.approx([30.0 / 0.75, 62.0, 12.0 / 0.9])
    assert [s.ms for s in samples_of_record(rec)] == pytest.approx([30.0, 62.0, 12.0]), "no ratio: as measured"
    assert [s.ms for s in samples_of_record(_record(None), ratios)] == pytest.approx([30.0, 62.0, 12.0])
    step = step_of_record(rec, ratios)
    p = BASE
    from flexorch.solver.cost_model import group_time_ms

    want = max(0.75 * group_time_ms([100], 1, "ulysses", p), group_time_ms([300], 2, "ring", p))
    want += 0.9 * group_time_ms([50], 1, "ulysses", p)
    assert step.predict_ms(p) == pytest.approx(want)
    assert step_of_record(_record(None), ratios).scales == ()


def test_the_step_line_says_how_many_groups_ran_without_recompute_and_the_packing():
    from flexorch.cli.train_console import format_step

    ev = {
        "step": 0, "shape": "<2> | <1>", "solve_s": 0.1, "loss": 5.0, "tokens_per_s": 100.0, "predicted_ms": 10.0,
        "compute_ms": 10.0, "measured_ms": 12.0, "eta_s": 1.0, "recompute": [["none", "full"], ["none"]],
        "recompute_packing": {"packing": "full", "full_ms": 10.0, "none_ms": 12.0},
    }  # fmt: skip
    assert format_step(ev, 10).endswith("[recompute: none in 2 of 3 groups]")
    ev["recompute"], ev["recompute_packing"]["packing"] = [["none"], ["none"], ["none"]], "none"
    assert format_step(ev, 10).endswith("[recompute: none in 3 of 3 groups (packed for no recompute)]")
    ev["recompute"], ev["recompute_packing"]["packing"] = [["selective"], ["selective"], ["none"]], "selective"
    line = format_step(ev, 10)
    assert line.endswith("[recompute: none in 1, selective in 2 of 3 groups (packed for selective recompute)]")
    del ev["recompute"]
    assert "recompute" not in format_step(ev, 10)
    # pipeline stages: how many of the step's layer runs (layers x units, on each stage) recompute in the backward
    ev["pipeline"] = {"layers": [3, 2], "checkpointed": [[3, 1, 0], [2, 0, 0]]}
    assert format_step(ev, 10).endswith("[recompute: 6 of 15 layer runs]")
    ev["pipeline"]["checkpointed"] = [[0, 0, 0], [0, 0, 0]]
    assert "recompute" not in format_step(ev, 10)


def test_the_modes_are_timed_on_the_longest_document_predicted_within_the_time_limit():
    from flexorch.control.recompute_choice import TIME_PROBE_MS, TIME_PROBE_TOKENS, probe_tokens
    from flexorch.solver.cost_model import group_time_ms

    def ms(n, profile):
        return group_time_ms([n], 1, "ulysses", profile)

    # a GPU-like profile: 16K tokens well within the limit, so the document is as long as the context allows
    fast = BASE.with_overrides(a1_ms=1e-8, a2_ms=1e-3, b1_ms=20.0)
    assert probe_tokens(fast, room_tokens=10**6, max_context=16384) == 16384
    assert probe_tokens(fast, room_tokens=9000, max_context=16384) == 9000  # what a worker holds without recompute
    # a slow profile: the longest document predicted within the limit, found exactly
    slow = BASE.with_overrides(a1_ms=1e-6, a2_ms=0.1, b1_ms=5.0)
    n = probe_tokens(slow, room_tokens=10**6, max_context=65536)
    assert TIME_PROBE_TOKENS < n < 65536
    assert ms(n, slow) <= TIME_PROBE_MS < ms(n + 1, slow)
    # never below the floor where a worker holds it, even when the floor alone is predicted past the limit
    slower = slow.with_overrides(a2_ms=10.0)
    assert ms(TIME_PROBE_TOKENS, slower) > TIME_PROBE_MS
    assert probe_tokens(slower, room_tokens=10**6, max_context=65536) == TIME_PROBE_TOKENS
    assert probe_tokens(slower, room_tokens=500, max_context=65536) == 500
    assert probe_tokens(slower, room_tokens=3, max_context=65536) == 16  # at least a tiny document
