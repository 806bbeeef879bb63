"""Plans on ranks of different speeds (issue 63): the topology's speeds, the simulator's pace, the placement, the
leveled MILP types and rows, and the planner beating the speed-blind plan priced with the same speeds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flexorch.cli.plan_speeds import token_shares
from flexorch.solver.packing import GroupType
from flexorch.solver.placement import place
from flexorch.solver.planner import PlannerConfig, fast_ranks
from flexorch.solver.profiles import get_profile
from flexorch.solver.simulator import step_time_ms
from flexorch.solver.speed_levels import level_rows, speed_levels
from flexorch.solver.step_planner import StepPlanner
from flexorch.solver.topology import Topology, TopologyError

PROFILE = get_profile("gpt-7b-a100")
CFG = PlannerConfig(time_limit_s=3.0, isolate=False)


def _lengths(n: int, cap: int, k: int = 48, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(np.log(cap) - 2, 1.3, k).astype(int) + 16, cap * n // 2)


# ---- the topology's speeds


def test_speeds_validate_round_trip_and_all_ones_is_none():
    t = Topology((2, 2), speeds=(1.0, 0.5, 1.0, 1.0))
    assert t.speed_of([0, 1]) == 0.5 and t.speed_of([2, 3]) == 1.0
    assert Topology.from_dict(t.to_dict()) == t
    assert "rank 1 0.50x" in t.describe()
    assert Topology((2, 2), speeds=(1, 1, 1, 1)) == Topology((2, 2))  # all 1.0: no speeds
    assert Topology((2, 2)).speed_of([0, 1, 2]) == 1.0 and Topology((4,)).to_dict() == {"node_sizes": [4]}
    assert t.without_speeds() == Topology((2, 2)) and t.without_speeds().with_speeds(t.speeds) == t
    with pytest.raises(TopologyError, match="3 speeds for 4 ranks"):
        Topology((2, 2), speeds=(1.0, 1.0, 1.0))
    with pytest.raises(TopologyError, match="rank 2 has 0"):
        Topology((4,), speeds=(1.0, 1.0, 0, 1.0))
    with pytest.raises(TopologyError, match="finite number"):
        Topology((2,), speeds=(float("nan"), 1.0))


def test_a_group_runs_at_its_slowest_members_pace():
    lengths = _lengths(4, PROFILE.tokens_per_device, k=12)
    with StepPlanner(PROFILE, CFG, static=("ulysses", 2)) as sp:
        plan = sp.plan(lengths, 4, with_baselines=False).plan
    nominal = step_time_ms(plan, PROFILE)
    slow = dataclasses.replace(plan, topology=Topology((4,), speeds=(0.5, 0.5, 0.5, 0.5)))
    assert step_time_ms(slow, PROFILE) - PROFILE.step_ms == pytest.approx(2 * (nominal - PROFILE.step_ms))
    one = dataclasses.replace(plan, topology=Topology((4,), speeds=(1.0, 0.25, 1.0, 1.0)))  # ranks 0-1 slow
    assert nominal < step_time_ms(one, PROFILE) <= 4 * nominal


# ---- placement


def test_heavier_groups_take_the_faster_slots_and_the_slow_rank_the_lightest():
    topo = Topology((4,), speeds=(0.5, 1.0, 1.0, 1.0))
    starts = place([1, 1, 1, 1], [False] * 4, topo, loads=[5.0, 9.0, 1.0, 7.0])
    assert starts[2] == 0  # the lightest group on the slow rank
    assert sorted(starts) == [0, 1, 2, 3]
    # a group of 2 avoids the slow rank where a slot without it is free
    assert place([2, 1, 1], [False] * 3, topo, loads=[9.0, 1.0, 2.0])[0] == 2
    # without speeds: the best fit at the run's start, as before speeds
    assert place([2, 1, 1], [False] * 3, Topology((4,)), loads=[9.0, 1.0, 2.0]) == [0, 2, 3]


def test_a_level_takes_the_slowest_slot_fast_enough_keeping_the_fast_ones():
    topo = Topology((4,), speeds=(1.0, 1.0, 2.0, 2.0))
    # the fast level's group of 2 goes to ranks 2-3; the slow level's to 0-1, even placed second
    assert place([2, 2], [False, False], topo, levels=[1.0, 2.0]) == [0, 2]


# ---- levels and their rows


def test_levels_merge_the_closest_and_rows_bound_the_fast_ranks():
    t = Topology((8,), speeds=(0.5, 0.52, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0))
    assert speed_levels(t, max_levels=3) == (0.5, 1.0, 2.0)  # 0.52 priced at 0.5
    assert speed_levels(t) == (0.5, 0.52, 1.0, 2.0)
    types = [GroupType(1, "ulysses", speed=0.5), GroupType(1, "ulysses", speed=1.0), GroupType(4, "ring", speed=1.0)]
    rows = dict((coef, cap) for coef, cap in level_rows(types, t, (0.5, 1.0)))
    assert rows[(0, 1, 4)] == 6  # d = 1: six ranks at >= 1.0 (2..7)
    assert rows[(0, 0, 4)] == 4  # d = 4: one slot of 4 in the run of 6


# ---- the planner


@pytest.mark.parametrize("n, slow", [(4, 0.5), (8, 0.5), (16, 0.25)])
def test_the_aware_plan_beats_the_blind_one_priced_with_the_same_speeds(n, slow):
    cap = PROFILE.tokens_per_device
    lengths = _lengths(n, cap)
    speeds = [1.0] * n
    speeds[-1] = slow
    base = Topology.single(n)
    with StepPlanner(PROFILE, CFG) as sp:
        aware = sp.plan(lengths, n, with_baselines=False, topology=base.with_speeds(speeds))
        blind = sp.plan(lengths, n, with_baselines=False, topology=base)
    assert aware.plan.topology.speeds == tuple(speeds)
    aware_ms = step_time_ms(aware.plan, PROFILE)
    assert aware.predicted_ms == pytest.approx(aware_ms)
    blind_ms = step_time_ms(dataclasses.replace(blind.plan, topology=base.with_speeds(speeds)), PROFILE)
    assert aware_ms < 0.95 * blind_ms, (aware_ms, blind_ms)
    shares = token_shares(aware.plan)
    assert shares[-1] < 0.85 / n  # the slow rank gets less than its even share
    assert token_shares(blind.plan)[-1] > shares[-1]


def test_a_faster_node_gets_more_work():
    n = 16
    speeds = [1.0] * 8 + [3.17] * 8  # H100s beside A100s (989 / 312 dense bf16 TFLOP/s)
    topo = Topology((8, 8))
    lengths = _lengths(n, PROFILE.tokens_per_device, k=64, seed=3)
    with StepPlanner(PROFILE, CFG) as sp:
        aware = sp.plan(lengths, n, with_baselines=False, topology=topo.with_speeds(speeds))
        blind = sp.plan(lengths, n, with_baselines=False, topology=topo)
    blind_ms = step_time_ms(dataclasses.replace(blind.plan, topology=topo.with_speeds(speeds)), PROFILE)
    assert step_time_ms(aware.plan, PROFILE) < 0.8 * blind_ms
    shares = token_shares(aware.plan)
    assert sum(shares[8:]) > 0.6


def test_the_fast_ranks_alone_keep_their_nodes():
    topo = Topology((4, 4), ("a", "b"), speeds=(1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.9))
    assert fast_ranks(topo) == Topology((3, 4), ("a", "b"))  # 0.9 is within FAST_WITHIN of the fastest
    assert fast_ranks(Topology((2, 2), speeds=(1.0, 1.0, 0.3, 0.3))) == Topology((2,))  # a node left empty goes
    assert fast_ranks(Topology((4,), speeds=(1.0, 0.9, 0.85, 1.0))) is None  # none slow
    assert fast_ranks(Topology((4,))) is None and fast_ranks(None) is None


def test_a_slow_rank_stays_out_of_the_long_documents_groups_and_takes_short_ones():
    # six documents that need two ranks each, and short ones: the long ones go to pairs of fast ranks, the slow
    # rank (3, at half speed) runs short documents alone, less than its even share, never idle all step
    cap = PROFILE.tokens_per_device
    rng = np.random.default_rng(5)
    lengths = np.concatenate([np.full(6, int(1.5 * cap)), rng.integers(cap // 20, cap // 3, 24)])
    speeds = (1.0, 1.0, 1.0, 0.5)
    base = Topology.single(4)
    with StepPlanner(PROFILE, CFG) as sp:
        aware = sp.plan(lengths, 4, with_baselines=False, topology=base.with_speeds(speeds))
        blind = sp.plan(lengths, 4, with_baselines=False, topology=base)
    for mb in aware.plan.micro_batches:
        for g in mb.groups:
            if 3 in g.ranks:
                assert all(lengths[i] <= cap for i in g.seq_ids), (g, mb)
    share = token_shares(aware.plan)[3]
    assert 0.0 < share < 0.85 / 4, token_shares(aware.plan)
    blind_ms = step_time_ms(dataclasses.replace(blind.plan, topology=base.with_speeds(speeds)), PROFILE)
    assert step_time_ms(aware.plan, PROFILE) < 0.85 * blind_ms
