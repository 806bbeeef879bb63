"""Each worker's speed from its ranks' measured micro-batch times (``flexorch.solver.worker_speeds``): one step's
speeds untangled and normalised, the estimate over steps (window, skips, drift, the console's changes), the planning
speeds' hysteresis, the accelerator-kind seeds, and the refit's samples at the others' pace."""

from __future__ import annotations

import random
import re

import pytest

from flexorch.solver.plan import Group, MicroBatch, Plan
from flexorch.solver.profiles import get_profile
from flexorch.solver.record_samples import samples_of_record, step_of_record
from flexorch.solver.simulator import group_timings, step_time_ms
from flexorch.solver.topology import Topology
from flexorch.solver.worker_speeds import (
    BAND,
    BAND_LIMITS,
    SLOW_BELOW,
    SpeedChange,
    WorkerSpeeds,
    seed_speeds,
    snap_speed,
    step_speeds,
)

PROFILE = get_profile("gpt-7b-a100")
LENGTHS = (6000, 3000, 2500, 4000, 3500, 9000)


def _plan(groups_per_mb, topology=None, lengths=LENGTHS) -> Plan:
    """``groups_per_mb``: per micro-batch, ``(first_rank, degree, seq_ids)`` per group (ulysses)."""
    mbs = [
        MicroBatch(tuple(Group(d, "ulysses", tuple(range(r, r + d)), tuple(ids)) for r, d, ids in mb))
        for mb in groups_per_mb
    ]
    n = 4 if topology is None else topology.num_devices
    return Plan.for_profile(num_devices=n, seq_lengths=lengths, micro_batches=mbs, profile=PROFILE, topology=topology)


# rank 0 shares a group with rank 1 and runs alone; rank 1 runs alone too; ranks 2 and 3 likewise
MIXED = [[(0, 2, [0]), (2, 1, [1]), (3, 1, [2])], [(0, 1, [3]), (1, 1, [4]), (2, 2, [5])]]


def _record(
    plan: Plan, speeds, *, noise=0.0, rng=None, scale=1.0, compile_s=(), modes=None, profile=PROFILE, waits=False
):
    """A trained step's record as ``records.writer.step_record`` writes it, each group taking its nominal time
    (the cost model where it lay, ``modes``' factor) over its slowest rank's speed, times ``scale`` and a noise
    of +-``noise``; ranks in ``compile_s`` compiled this step. ``waits``: each rank also says what it waited of its
    group's time (``wait_ms``, as CPU workers do): the group's time less its own at its speed, plus a transfer of a
    tenth of the nominal time that every member waits (at any pace: the group takes 0.9 / pace + 0.1 of it)."""
    rng = rng or random.Random(0)
    nominal = plan if plan.topology is None else Plan(**{**plan.__dict__, "topology": plan.topology.without_speeds()})
    n_mb = len(plan.micro_batches)
    ratio = profile.mode_time_ratios()
    ranks = [{"micro_batch_ms": [None] * n_mb, "compile_s": 0.0} for _ in range(plan.num_devices)]
    for t in group_timings(nominal, profile):
        g = plan.micro_batches[t.micro_batch].groups[t.group]
        pace = min(speeds[r] for r in g.ranks)
        mode = 1.0 if modes is None else ratio[modes[t.micro_batch][t.group]]
        ms = t.time_ms * mode / pace * scale * (1 + rng.uniform(-noise, noise))
        if waits:  # the transfers (a tenth) take as long at any pace
            ms = (0.9 / pace + 0.1) * t.time_ms * mode * scale
        for r in g.ranks:
            ranks[r]["micro_batch_ms"][t.micro_batch] = ms
            if waits:
                own = 0.9 * t.time_ms * mode / speeds[r] * scale
                ranks[r].setdefault("wait_ms", [None] * n_mb)[t.micro_batch] = ms - own
    for r in compile_s:
        ranks[r]["compile_s"] = 3.5
    rec = {"source": "train", "pipeline": None, "plan": plan.to_dict(), "ranks": ranks, "measured_ms": 1.0}
    rec["compute_ms"] = 1.0
    if modes is not None:
        rec["recompute"] = modes
    return rec


# ---- one step


def test_a_slow_rank_is_untangled_from_the_partner_it_shared_a_group_with():
    got = step_speeds(_record(_plan(MIXED), [1.0, 0.5, 1.0, 1.0]), PROFILE)
    assert got == pytest.approx({0: 1.0, 1: 0.5, 2: 1.0, 3: 1.0})


def test_two_ranks_always_paired_are_told_apart_by_what_each_waited():
    # ranks 2 and 3 only ever run together; rank 3 is slow: the group's times alone cannot say which one is
    plan = _plan([[(0, 2, [0]), (2, 2, [1])], [(0, 2, [3]), (2, 2, [4])], [(0, 2, [2, 5])]])
    speeds = [1.0, 1.0, 1.0, 0.5]
    blind = step_speeds(_record(plan, speeds), PROFILE)
    assert blind[2] == blind[3] == pytest.approx(0.5)  # without the waits both look slow
    got = step_speeds(_record(plan, speeds, waits=True), PROFILE)
    # rank 3 set the pace (0.9 / 0.5 + 0.1 of the nominal time); rank 2 waited for it and says nothing this step
    assert got == pytest.approx({0: 1.0, 1: 1.0, 3: 1 / 1.9})
    # over steps: only rank 3 is estimated slow, and its partner is planned at full speed
    est = WorkerSpeeds(skip_first=0)
    for _ in range(3):
        est.observe(_record(plan, speeds, waits=True), PROFILE, [10, 11, 12, 13])
    assert est.planning_speeds([10, 11, 12, 13]) == (1.0, 1.0, 1.0, snap_speed(1 / 1.9))


def test_a_member_that_waited_for_its_partner_is_not_called_fast():
    # rank 0 waited nearly all of its group's time in micro-batch 0: rank 1 set that pace, and no one is faster
    plan = _plan(MIXED)
    rec = _record(plan, [1.0, 1.0, 1.0, 1.0], waits=True)
    rec["ranks"][0]["wait_ms"][0] = 0.99 * rec["ranks"][0]["micro_batch_ms"][0]
    assert step_speeds(rec, PROFILE) == pytest.approx({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0})
    # members alike in their own work: neither is pinned, the group's pace is theirs as without the waits
    alike = _record(plan, [1.0, 0.5, 1.0, 1.0], waits=True)
    alike["ranks"][0]["wait_ms"][0] = alike["ranks"][1]["wait_ms"][0]
    assert step_speeds(alike, PROFILE) == pytest.approx({0: 1.0, 1: 1 / 1.9, 2: 1.0, 3: 1.0})  # rank 0 ran alone too


def test_a_rank_whose_only_group_a_pinned_slow_rank_explains_says_nothing():
    # rank 0 ran only with rank 1; rank 1 ran alone at 0.5 too: rank 0's speed is unknown this step, not 0.5
    plan = _plan([[(0, 2, [0]), (2, 1, [1]), (3, 1, [2, 4])], [(1, 1, [3]), (2, 2, [5])]])
    got = step_speeds(_record(plan, [1.0, 0.5, 1.0, 1.0]), PROFILE)
    assert 0 not in got and got == pytest.approx({1: 0.5, 2: 1.0, 3: 1.0})
    # never apart: both bounded by the group, both said at its pace (nothing tells them apart)
    together = _plan([[(0, 2, [0, 1]), (2, 1, [2]), (3, 1, [3])], [(0, 2, [4]), (2, 2, [5])]])
    assert step_speeds(_record(together, [1.0, 0.5, 1.0, 1.0]), PROFILE) == pytest.approx(
        {0: 0.5, 1: 0.5, 2: 1.0, 3: 1.0}
    )


def test_speeds_are_relative_to_the_steps_median_rank():
    # a cost model 1.7x too optimistic for everyone moves no one
    got = step_speeds(_record(_plan(MIXED), [1.0, 0.5, 1.0, 1.0], scale=1.7), PROFILE)
    assert got == pytest.approx({0: 1.0, 1: 0.5, 2: 1.0, 3: 1.0})
    # of two workers the faster is 1.0 (the upper median), so the slow one is called slow
    two = Plan.for_profile(
        num_devices=2,
        seq_lengths=(4000, 3000),
        micro_batches=[MicroBatch((Group(1, "ulysses", (0,), (0,)), Group(1, "ulysses", (1,), (1,))))],
        profile=PROFILE,
    )
    assert step_speeds(_record(two, [1.0, 0.5]), PROFILE) == pytest.approx({0: 1.0, 1: 0.5})


def test_groups_are_priced_where_they_lay_and_in_their_recompute_mode():
    # two nodes of two: the group on ranks 1 and 2 spans them (inter-node figures), and is all they ran; the plan
    # carries the speeds it was priced with, the estimate uses the nominal price
    topo = Topology((2, 2), speeds=(1.0, 0.5, 1.0, 1.0))
    plan = _plan([[(0, 1, [1]), (1, 2, [5]), (3, 1, [2])], [(0, 1, [0]), (1, 2, [4]), (3, 1, [3])]], topology=topo)
    inter = PROFILE.with_overrides(inter_a2a_gbps={d: 5.0 for d in (2, 4, 8)})  # a slow link between the nodes
    rec = _record(plan, [1.0, 1.0, 1.0, 1.0], profile=inter)
    assert step_speeds(rec, inter) == pytest.approx({r: 1.0 for r in range(4)})
    profile = PROFILE.with_overrides(none_time_ratio=0.7, selective_time_ratio=0.85)
    modes = [["none", "full", "selective"], ["full", "none", "full"]]
    rec = _record(_plan(MIXED), [1.0, 0.5, 1.0, 1.0], modes=modes, profile=profile)
    assert step_speeds(rec, profile) == pytest.approx({0: 1.0, 1: 0.5, 2: 1.0, 3: 1.0})
    blind = step_speeds({**rec, "recompute": None}, profile)  # without the modes the mode's groups look fast
    assert blind != pytest.approx({0: 1.0, 1: 0.5, 2: 1.0, 3: 1.0})


def test_a_rank_given_a_sliver_of_the_step_says_nothing_of_its_speed():
    # rank 3 ran one short document; its measured time is 3x the cost model's (fixed costs the model misses on so
    # little work): not evidence that it is slow, or it would be given less still
    lengths = (6000, 3000, 150, 4000, 3500, 3000)
    profile = PROFILE.with_overrides(b1_ms=0.0)  # no fixed cost per group: the short document's price is small
    plan = _plan([[(0, 2, [0]), (2, 1, [1]), (3, 1, [2])], [(0, 1, [3]), (1, 1, [4]), (2, 1, [5])]], lengths=lengths)
    rec = _record(plan, [1.0, 1.0, 1.0, 1.0], profile=profile)
    rec["ranks"][3]["micro_batch_ms"][0] *= 3
    assert rec["ranks"][3]["micro_batch_ms"][0] < 0.15 * sum(rec["ranks"][0]["micro_batch_ms"])
    assert step_speeds(rec, profile) == pytest.approx({0: 1.0, 1: 1.0, 2: 1.0})
    # ... but a sliver at full pace says a rank taken as slow is back
    fast = _record(_plan([[(0, 2, [0]), (2, 1, [1]), (3, 1, [2])], [(0, 1, [3]), (1, 1, [4]), (2, 1, [5])]],
                         lengths=lengths), [1.0, 1.0, 1.0, 1.0], profile=profile)  # fmt: skip
    assert 3 not in step_speeds(fast, profile, priors={0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0})
    assert step_speeds(fast, profile, priors={0: 1.0, 1: 1.0, 2: 1.0, 3: 0.4})[3] == pytest.approx(1.0)
    assert 3 not in step_speeds(rec, profile, priors={0: 1.0, 1: 1.0, 2: 1.0, 3: 0.4})  # slow on it: nothing
    # the same pace on a real share of the step is evidence
    plan = _plan([[(0, 2, [0]), (2, 1, [1]), (3, 1, [2, 5])], [(0, 1, [3]), (1, 1, [4])]], lengths=lengths)
    rec = _record(plan, [1.0, 1.0, 1.0, 0.4], profile=profile)
    assert step_speeds(rec, profile)[3] == pytest.approx(0.4)


def test_compiling_and_lost_ranks_and_other_records_are_left_out():
    rec = _record(_plan(MIXED), [1.0, 0.5, 1.0, 1.0], compile_s=[1])
    for mi in range(2):
        rec["ranks"][1]["micro_batch_ms"][mi] *= 20  # the compile's time: not a slow worker
    got = step_speeds(rec, PROFILE)
    assert 1 not in got and got == pytest.approx({0: 1.0, 2: 1.0, 3: 1.0})  # rank 0 ran alone too
    rec = _record(_plan(MIXED), [1.0, 1.0, 1.0, 1.0])
    rec["ranks"][3] = None  # lost after the update
    assert step_speeds(rec, PROFILE) == pytest.approx({0: 1.0, 1: 1.0, 2: 1.0})
    ok = _record(_plan(MIXED), [1.0, 0.5, 1.0, 1.0])
    for bad in ({"source": "plan"}, {"pipeline": {"stages": 2}}, {"plan": None}):
        assert step_speeds({**ok, **bad}, PROFILE) == {}
        assert WorkerSpeeds(skip_first=0).observe({**ok, **bad}, PROFILE, [0, 1, 2, 3]) == []


# ---- over steps


def _feed(ws, speeds, steps, *, noise=0.03, seed=0, plan=None, workers=(10, 11, 12, 13), nodes=None):
    rng = random.Random(seed)
    changes = []
    for _ in range(steps):
        rec = _record(plan or _plan(MIXED), speeds, noise=noise, rng=rng)
        changes += ws.observe(rec, PROFILE, list(workers), nodes)
    return changes


def test_a_worker_at_half_speed_is_estimated_so_and_said_once():
    ws = WorkerSpeeds(window=3, skip_first=1)
    assert _feed(ws, [1.0, 0.5, 1.0, 1.0], 1) == [] and ws.estimate(11) == 1.0  # a world's first step: left out
    changes = _feed(ws, [1.0, 0.5, 1.0, 1.0], 5, nodes=["a", "b", "c", "d"])
    assert 0.45 <= ws.estimate(11) <= 0.55
    assert all(0.95 <= ws.estimate(w) <= 1.05 for w in (10, 12, 13)), "its partner in a degree-2 group is not slow"
    assert len(changes) == 1 and changes[0].slow and (changes[0].worker, changes[0].rank) == (11, 1)
    assert changes[0].steps == 2, "the window's median goes below on the second slow step"
    assert changes[0].message().startswith("worker 11 on node b runs at 0.5")
    assert changes[0].message().endswith("x the others for 2 steps; planning around it")
    assert ws.slow_steps(11) == 5 and ws.slow_steps(10) == 0
    assert ws.planning_speeds([10, 11, 12, 13]) == (1.0, 0.5, 1.0, 1.0)


def test_a_recovered_worker_is_back_on_its_first_fast_step_and_a_drop_needs_two():
    ws = WorkerSpeeds(window=3, skip_first=0)
    _feed(ws, [1.0, 0.5, 1.0, 1.0], 4)
    assert ws.planning_speeds([10, 11, 12, 13])[1] == 0.5
    back = _feed(ws, [1.0, 1.0, 1.0, 1.0], 1, seed=1)  # the next plan gives it its full share
    assert len(back) == 1 and not back[0].slow and back[0].steps == 4 and ws.estimate(11) >= 0.9
    said = r"worker 11 is back to (0\.9\d|1\.0\d)x the others; it gets its full share again"
    assert re.fullmatch(said, back[0].message()), back[0].message()
    assert ws.planning_speeds([10, 11, 12, 13]) == (1.0,) * 4
    assert _feed(ws, [1.0, 1.0, 1.0, 1.0], 3, seed=3) == [], "said once"
    assert _feed(ws, [1.0, 0.5, 1.0, 1.0], 1, seed=4) == [] and ws.estimate(11) >= 0.9  # one slow step: noise
    again = _feed(ws, [1.0, 0.5, 1.0, 1.0], 1, seed=5)
    assert len(again) == 1 and again[0].slow and ws.estimate(11) < SLOW_BELOW


def test_a_fast_rank_always_paired_with_a_known_slow_one_is_not_called_slow():
    ws = WorkerSpeeds(window=3, skip_first=0)
    _feed(ws, [1.0, 0.5, 1.0, 1.0], 3)  # rank 1 seen slow on its own
    paired = _plan([[(0, 2, [0, 3]), (2, 2, [1, 4])], [(0, 2, [2]), (2, 2, [5])]])  # ranks 0, 1 always together
    changes = _feed(ws, [1.0, 0.5, 1.0, 1.0], 4, plan=paired)
    assert changes == [] and ws.estimate(10) >= 0.95 and ws.estimate(11) <= 0.55
    assert step_speeds(_record(paired, [1.0, 0.5, 1.0, 1.0]), PROFILE) == pytest.approx(
        {0: 0.5, 1: 0.5, 2: 1.0, 3: 1.0}, abs=0.02
    )  # without priors the pair cannot be told apart


def test_a_new_world_skips_its_first_steps_and_compile_steps_move_nothing():
    ws = WorkerSpeeds(window=3, skip_first=2)
    _feed(ws, [1.0, 0.5, 1.0, 1.0], 2)
    assert ws.estimate(11) == 1.0
    rng = random.Random(5)
    for _ in range(3):  # rank 1 compiles every step: its groups say nothing
        ws.observe(_record(_plan(MIXED), [1.0, 0.3, 1.0, 1.0], rng=rng, compile_s=[1]), PROFILE, [10, 11, 12, 13])
    assert ws.estimate(11) == 1.0 and ws.estimate(10) == pytest.approx(1.0, abs=0.01)
    _feed(ws, [1.0, 0.5, 1.0, 1.0], 2)
    assert ws.estimate(11) == pytest.approx(0.5, abs=0.05)
    ws.new_world()
    _feed(ws, [1.0, 1.0, 1.0, 1.0], 2)  # left out: still slow
    assert ws.estimate(11) == pytest.approx(0.5, abs=0.05)
    assert ws.observe(_record(_plan(MIXED), [1.0] * 4), PROFILE, [10, 11, 12]) == [], "another world's record"


def test_a_worker_left_idle_drifts_back_so_it_is_tried_again():
    ws = WorkerSpeeds(window=3, skip_first=0)
    _feed(ws, [1.0, 0.5, 1.0, 1.0], 3)
    idle = _plan([[(0, 1, [0]), (2, 2, [1, 2])], [(0, 1, [3]), (2, 2, [5])], [(0, 1, [4])]])  # rank 1 in no group
    est = []
    for _ in range(6):
        _feed(ws, [1.0, 0.5, 1.0, 1.0], 1, plan=idle)
        est.append(ws.estimate(11))
    assert est[0] == pytest.approx(0.5, abs=0.03), "one idle step moves nothing"
    assert est[1] == pytest.approx(0.75, abs=0.02) and est == sorted(est) and est[-1] > 0.97
    assert ws.planning_speeds([10, 11, 12, 13])[1] == 1.0
    _feed(ws, [1.0, 0.5, 1.0, 1.0], 2)  # still slow once tried: slow again (said once: it never recovered)
    assert ws.estimate(11) == pytest.approx(0.5, abs=0.05)


@pytest.mark.parametrize("speed", [0.5, 0.52, 0.62, 0.7, 0.9, 1.0, 1.3])
def test_planning_speeds_hold_under_three_percent_noise(speed):
    ws = WorkerSpeeds(window=3, skip_first=0)
    seen = []
    for step in range(40):
        _feed(ws, [1.0, speed, 1.0, 1.0], 1, seed=step)
        seen.append(ws.planning_speeds([10, 11, 12, 13]))
    settled = seen[3:]
    assert len(set(settled)) == 1, f"the planning speeds changed under noise: {sorted(set(settled))}"
    assert settled[0][1] == pytest.approx(snap_speed(speed), abs=0.08) and settled[0][0] == 1.0


def test_the_band_follows_the_noise_the_run_measures():
    # a worker at 0.75x: planned around where steps measure +-2 % (a GPU), not where they measure +-30 % (CPU
    # workers time-sharing cores, where such a speed is as likely noise)
    workers = [10, 11, 12, 13]
    quiet, noisy = WorkerSpeeds(skip_first=0), WorkerSpeeds(skip_first=0)
    assert quiet.band == BAND  # nothing measured yet
    _feed(quiet, [1.0, 0.75, 1.0, 1.0], 30, noise=0.02)
    _feed(noisy, [1.0, 0.75, 1.0, 1.0], 30, noise=0.3, seed=1)
    assert quiet.band == pytest.approx(BAND_LIMITS[0]) and quiet.planning_speeds(workers) == (1.0, 0.75, 1.0, 1.0)
    assert noisy.band >= 0.25 and noisy.planning_speeds(workers) == (1.0, 1.0, 1.0, 1.0)
    _feed(noisy, [1.0, 0.4, 1.0, 1.0], 3, noise=0.3, seed=2)  # a real straggler stands out of the noise
    assert noisy.planning_speeds(workers)[1] < 0.65


def test_snapping():
    assert [snap_speed(v) for v in (0.9, 0.95, 1.1, 1.04, 0.81, 1.19)] == [1.0] * 6
    assert [snap_speed(v) for v in (0.79, 0.52, 0.53, 1.21, 0.01, 2.0)] == [0.8, 0.5, 0.55, 1.2, 0.05, 2.0]


def test_forget_drops_the_estimate_and_the_seed():
    ws = WorkerSpeeds(skip_first=0, seeds={11: 0.4})
    assert ws.estimate(11) == 0.4 and ws.planning_speeds([11]) == (0.4,)
    ws.forget(11)
    assert ws.estimate(11) == 1.0 and ws.slow_steps(11) == 0
    with pytest.raises(ValueError):
        WorkerSpeeds(window=0)


def test_speed_change_messages_without_a_node():
    change = SpeedChange(worker=3, rank=2, node=None, speed=0.523, steps=1, slow=True)
    assert change.message() == "worker 3 runs at 0.52x the others for 1 step; planning around it"


# ---- seeds


def test_seeds_come_from_the_kinds_datasheet_figures():
    got = seed_speeds({0: "A100", 1: "A100", 2: "H100", 3: "H100", 4: "H100"})
    assert got[2] == 1.0 and got[0] == pytest.approx(312 / 989)
    assert seed_speeds({0: "A100-80G", 1: "A100-40G"}) == {0: 1.0, 1: 1.0}
    assert seed_speeds({0: "H100", 1: "TPU-V4", 2: None}) == {0: 1.0, 1: 1.0, 2: 1.0}, "unknown: the median's"
    mix = seed_speeds({0: "AMD-Instinct-MI300X-OAM", 1: "H100", 2: "V100"})
    assert mix[1] == 1.0 and mix[0] == pytest.approx(1307 / 989) and mix[2] == pytest.approx(125 / 989)
    assert seed_speeds({}) == {} and seed_speeds({0: None, 1: None}) == {0: 1.0, 1: 1.0}
    ws = WorkerSpeeds(skip_first=0, seeds=got)
    assert ws.estimate(0) == pytest.approx(0.315, abs=0.01) and ws.planning_speeds([0, 2]) == (0.3, 1.0)


# ---- the refit and the step level at the others' pace


def test_the_refit_counts_a_slow_workers_groups_at_the_others_pace():
    rec = _record(_plan(MIXED), [1.0, 0.5, 1.0, 1.0])
    before = [s.ms for s in samples_of_record(rec)]
    for entry, speed in zip(rec["ranks"], [1.0, 0.5, 1.0, 1.0], strict=True):
        entry["speed"] = speed
    after = [s.ms for s in samples_of_record(rec)]
    # groups in plan order: {0,1}, {2}, {3}, {0}, {1}, {2,3}: those with rank 1 at half their measured time
    assert after == pytest.approx([b * f for b, f in zip(before, [0.5, 1, 1, 1, 0.5, 1], strict=True)])
    nominal = _record(_plan(MIXED), [1.0] * 4)
    assert after == pytest.approx([s.ms for s in samples_of_record(nominal)])


def test_the_step_of_a_plan_priced_with_speeds_predicts_what_it_was_priced_at():
    plan = _plan(MIXED, topology=Topology((4,), speeds=(1.0, 0.5, 1.0, 1.0)))
    step = step_of_record(_record(plan, [1.0, 0.5, 1.0, 1.0]))
    assert step.predict_ms(PROFILE) == pytest.approx(step_time_ms(plan, PROFILE))
    assert step.predict_ms(PROFILE) > step_time_ms(plan.__class__(**{**plan.__dict__, "topology": None}), PROFILE)


def test_two_ranks_taken_as_slow_alike_are_not_held_slow_by_the_groups_they_share():
    ws = WorkerSpeeds(window=3, skip_first=0)
    _feed(ws, [0.5, 0.5, 1.0, 1.0], 3)  # both seen slow, each on its own
    assert ws.estimate(10) <= 0.55 and ws.estimate(11) <= 0.55
    paired = _plan([[(0, 2, [0, 3]), (2, 2, [1, 4])], [(0, 2, [2]), (2, 2, [5])]])  # then only ever together
    _feed(ws, [0.5, 1.0, 1.0, 1.0], 4, plan=paired)  # rank 1 is back: its pair still runs at rank 0's pace
    assert ws.estimate(11) > 0.6, "the pair says nothing of which: unobserved, it drifts back and is tried again"
    _feed(ws, [0.5, 1.0, 1.0, 1.0], 2)  # planned apart again: told apart
    assert ws.estimate(11) >= 0.9 and ws.estimate(10) <= 0.55
