"""Every plan the planner returns satisfies the invariants, and a Plan refuses to exist when one is broken."""

import numpy as np
import pytest

from flexorch.data.lengths import bundled_lengths_path, read_lengths
from flexorch.solver import (
    Group,
    InvalidPlanError,
    MicroBatch,
    Plan,
    PlannerConfig,
    get_profile,
    min_degree,
    plan_step,
    step_time_ms,
)
from flexorch.solver.baselines import baseline_times_ms
from tests.solver_helpers import TINY


def _check_plan(plan, lengths, n, profile):
    """The invariants, checked independently of Plan.__post_init__."""
    seen = []
    for mb in plan.micro_batches:
        used = set()
        for g in mb.groups:
            d = g.degree
            assert d & (d - 1) == 0 and g.ranks == tuple(range(g.ranks[0], g.ranks[0] + d))
            assert g.ranks[0] % d == 0 and g.ranks[-1] < n
            assert not used.intersection(g.ranks)
            used.update(g.ranks)
            if g.kind == "ulysses":
                assert profile.num_heads % d == 0
            toks = sum(lengths[i] for i in g.seq_ids)
            assert toks <= d * profile.tokens_per_device
            for i in g.seq_ids:
                assert d >= min_degree(int(lengths[i]), profile.tokens_per_device)
            seen.extend(g.seq_ids)
    assert sorted(seen) == list(range(len(lengths)))


@pytest.mark.parametrize("n", [1, 3, 6, 8, 16, 64])
def test_real_batches_give_valid_plans_close_to_or_better_than_best_static(n):
    profile = get_profile("gpt-7b-a100")
    data = read_lengths(bundled_lengths_path())
    rng = np.random.default_rng(n)
    limit = (1 << (n.bit_length() - 1)) * profile.tokens_per_device
    data = data[data <= limit]
    ours, theirs = [], []
    for _ in range(2):
        lengths = rng.choice(data, size=96)
        res = plan_step(lengths, n, profile, PlannerConfig(time_limit_s=0.5))
        _check_plan(res.plan, lengths, n, profile)
        assert res.predicted_ms == pytest.approx(step_time_ms(res.plan, profile))
        assert res.bound_ms <= res.predicted_ms * (1 + 1e-9)
        ours.append(res.predicted_ms)
        theirs.append(baseline_times_ms(lengths, n, profile)["batchada"])
    # the best static layout per micro-batch is every MILP's starting point, but the two pick micro-batch splits
    # differently, so on a single batch the planner can trail BatchAda slightly; never by more than 2 %
    assert sum(ours) <= sum(theirs) * 1.02


def test_plan_json_fields():
    res = plan_step([10, 20, 300, 5], 4, TINY)
    d = res.plan.to_dict()
    group = d["micro_batches"][0][0]
    assert set(group) == {"degree", "kind", "ranks", "seq_lengths", "seq_ids"}
    ids = sorted(i for mb in d["micro_batches"] for g in mb for i in g["seq_ids"])
    assert ids == [0, 1, 2, 3]


def _plan(groups_per_mb, lengths=(50, 60), n=4):
    return Plan(
        num_devices=n,
        seq_lengths=tuple(lengths),
        micro_batches=tuple(MicroBatch(tuple(gs)) for gs in groups_per_mb),
        tokens_per_device=100,
        num_heads=4,
    )


def test_valid_hand_made_plan():
    _plan([[Group(2, "ulysses", (0, 1), (0,)), Group(1, "ulysses", (2,), (1,))]])


@pytest.mark.parametrize(
    "groups, msg",
    [
        ([[Group(1, "ulysses", (0,), (0,))]], "missing \\[1\\]"),
        (
            [[Group(2, "ulysses", (0, 1), (0, 1))], [Group(1, "ulysses", (0,), (1,))]],
            "more than once \\[1\\]",
        ),
        ([[Group(2, "ulysses", (0, 1), (0,)), Group(1, "ulysses", (1,), (1,))]], "two groups"),
        ([[Group(2, "ulysses", (0, 1), (0,)), Group(2, "ring", (4, 5), (1,))]], "exceed N=4"),
        ([[Group(1, "ulysses", (0,), (0, 1))]], "over its memory budget of 100"),
    ],
)
def test_broken_plans_are_refused(groups, msg):
    with pytest.raises(InvalidPlanError, match=msg):
        _plan(groups)


def test_broken_groups_are_refused():
    with pytest.raises(InvalidPlanError, match="consecutive ranks"):
        Group(2, "ring", (1, 3), (0,))
    assert Group(2, "ring", (1, 2), (0,)).ranks == (1, 2)  # a block inside a node need not be aligned
    with pytest.raises(InvalidPlanError, match="ulysses_degree"):
        Group(4, "hybrid", (0, 1, 2, 3), (0,))
    with pytest.raises(InvalidPlanError, match="ulysses_degree"):
        Group(4, "hybrid", (0, 1, 2, 3), (0,), ulysses_degree=4)  # r = 1 is plain Ulysses
    with pytest.raises(InvalidPlanError, match="only a hybrid"):
        Group(4, "ring", (0, 1, 2, 3), (0,), ulysses_degree=2)
    assert Group(4, "hybrid", (0, 1, 2, 3), (0,), ulysses_degree=2).ulysses_degree == 2
    with pytest.raises(InvalidPlanError, match="power of two"):
        Group(3, "ring", (0, 1, 2), (0,))
    with pytest.raises(InvalidPlanError, match="kind"):
        Group(1, "magic", (0,), (0,))
    with pytest.raises(InvalidPlanError, match="no sequence"):
        Group(1, "ring", (0,), ())


def test_degree_below_minimum_and_heads_are_refused():
    with pytest.raises(InvalidPlanError, match="needs degree >= 4"):
        _plan([[Group(2, "ring", (0, 1), (0, 1))]], lengths=(350, 1), n=8)
    with pytest.raises(InvalidPlanError, match="does not divide num_heads=4"):
        _plan([[Group(8, "ulysses", tuple(range(8)), (0, 1))]], n=8)


@pytest.mark.slow
def test_parallel_micro_batch_solves_in_worker_processes():
    profile = get_profile("gpt-7b-a100")
    lengths = np.random.default_rng(5).choice(read_lengths(bundled_lengths_path()), size=512)
    lengths = lengths[lengths <= 64 * profile.tokens_per_device]
    config = PlannerConfig(workers=2, time_limit_s=2.0)
    from flexorch.solver import Planner

    with Planner(profile, config) as planner:
        first = planner.plan(lengths, 64)
        second = planner.plan(lengths[::-1].copy(), 64)  # the pool is reused across steps
    for res, ls in ((first, lengths), (second, lengths[::-1])):
        _check_plan(res.plan, ls, 64, profile)
        assert len(res.plan.micro_batches) >= 2  # 512 Wikipedia documents need two micro-batches on 64 A100s
        assert res.bound_ms <= res.predicted_ms


def test_memory_full_micro_batches_are_judged_by_what_they_pack_into():
    # 99 x 1000 tokens on 8 devices of 6250 tokens: two micro-batches are 99 % full and pack only into groups of
    # 4 or 8; a third micro-batch frees single-device groups but pays b1 once more. No LP bound tells these apart,
    # so the planner screens splits by their packed layouts; it must not trail the best static layout.
    profile = get_profile("gpt-7b-a100")
    lengths = np.full(99, 1000)
    res = plan_step(lengths, 8, profile)
    best_static = baseline_times_ms(lengths, 8, profile)["batchada"]
    assert res.predicted_ms <= best_static * 1.02
    assert res.predicted_ms <= res.bound_ms * 1.5
