"""Several tasks in one step as one executable Plan (flexorch/solver/multitask/execute.py; Spindle, arXiv 2409.03365)
and whole-MetaOp schedules (``split_layers=False``). Pure and fast (no Ray, no torch)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from flexorch.solver.cost_model import group_time_ms
from flexorch.solver.errors import InfeasibleBatchError, InvalidPlanError, PlanningError
from flexorch.solver.multitask import MetaOp, TaskBatch, plan_metaops, plan_tasks
from flexorch.solver.multitask.execute import (
    check_single_task,
    dataflow_time_ms,
    default_sp_planner,
    plan_task_step,
    task_groups,
)
from flexorch.solver.plan import Group, MicroBatch, Plan
from flexorch.solver.planner import PlannerConfig
from flexorch.solver.profiles import get_profile
from flexorch.solver.simulator import step_time_ms
from flexorch.solver.step_planner import StepPlanner, heuristic_plan

PROFILE = get_profile("gpt-7b-a100")


def random_metaop(rng, task: int, num_devices: int, layers: int, level: int = 0) -> MetaOp:
    """T(n) = a/n^alpha + b, jagged, sometimes infeasible on the fewest counts."""
    counts = np.array([1 << k for k in range(num_devices.bit_length())], dtype=float)
    t = rng.uniform(1, 20) / counts ** rng.uniform(0.4, 1.0) + rng.uniform(0.0, 2.0)
    t = np.minimum.accumulate(t * rng.uniform(0.9, 1.1, size=t.size))
    if rng.random() < 0.3:
        t[: rng.integers(1, 3)] = math.inf
    return MetaOp(task=task, level=level, layers=layers, layer_ms=tuple(t), name=f"t{task}/{level}")


def skewed_batch(seed: int = 0):
    """Task 0: two long sequences (20K and 18K tokens: 4 devices each); tasks 1 and 2: many short ones."""
    rng = np.random.default_rng(seed)
    lengths = [20_000, 18_000] + rng.integers(500, 3000, 40).tolist() + rng.integers(300, 2000, 60).tolist()
    task_of = [0] * 2 + [1] * 40 + [2] * 60
    return lengths, task_of


def random_batch(rng, num_tasks: int, longest: int):
    lengths, task_of = [], []
    for t in range(num_tasks):
        k = int(rng.integers(1, 30))
        lengths += rng.lognormal(7, 1.3, size=k).clip(16, longest).astype(int).tolist()
        task_of += [t] * k
    order = rng.permutation(len(lengths))  # tasks interleaved in the batch: ids must map back
    return [lengths[i] for i in order], [task_of[i] for i in order]


def check_executable(plan: Plan, info: dict, task_of, num_devices: int) -> None:
    """Every group one task, every sequence once, each task's groups inside its part's block, and every rank meets
    the parts in the order the schedule starts them there."""
    groups = task_groups(plan, task_of)
    ids = sorted(i for mb in plan.micro_batches for g in mb.groups for i in g.seq_ids)
    assert ids == list(range(len(task_of)))
    part_of = {task: (first, size, start) for task, first, size, start, _ in info["parts"]}
    assert sorted(part_of) == list(range(info["tasks"]))  # whole tasks: one part each
    seen: list[list[int]] = [[] for _ in range(num_devices)]
    for mb, tasks in zip(plan.micro_batches, groups, strict=True):
        for g, t in zip(mb.groups, tasks, strict=True):
            first, size, _ = part_of[t]
            assert first <= g.ranks[0] and g.ranks[-1] < first + size
            for r in g.ranks:
                if not seen[r] or seen[r][-1] != t:
                    seen[r].append(t)
    for r, order in enumerate(seen):
        assert len(order) == len(set(order)), f"rank {r} returns to a task: {order}"
        starts = [part_of[t][2] for t in order]
        assert starts == sorted(starts), f"rank {r} runs tasks {order}, against the schedule's starts {starts}"


# --- whole MetaOps: split_layers=False ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_whole_metaops_give_one_part_each_and_beat_the_baselines(seed):
    rng = np.random.default_rng(400 + seed)
    n_dev = int(rng.choice([4, 8, 16, 32]))
    metaops = []
    for t in range(int(rng.integers(2, 6))):
        metaops.append(random_metaop(rng, t, n_dev, int(rng.integers(1, 33))))
        if rng.random() < 0.3:  # a chain of two MetaOps: still one part each
            metaops.append(random_metaop(rng, t, n_dev, int(rng.integers(1, 5)), level=1))
    plan = plan_metaops(metaops, n_dev, split_layers=False)  # a MultiTaskPlan: validated on construction
    assert sorted((p.task, p.metaop) for p in plan.parts) == sorted((m.task, m.level) for m in metaops)
    assert all(p.layers == m.layers for p in plan.parts for m in metaops if (m.task, m.level) == (p.task, p.metaop))
    finite = [v for v in plan.baselines_ms.values() if math.isfinite(v)]
    assert plan.makespan_ms <= min(finite) * (1 + 1e-9)
    assert plan.bound_ms <= plan.makespan_ms * (1 + 1e-9)


def test_split_layers_is_what_splits_a_metaop():
    # the continuous optimum of this pair lies between counts: the default plan splits some MetaOp's layers
    rng = np.random.default_rng(7)
    tasks = [TaskBatch(name=f"t{i}", lengths=rng.integers(200, 9000, size=40), adapter_rank=8) for i in range(3)]
    split = plan_tasks(tasks, 16, PROFILE)
    whole = plan_tasks(tasks, 16, PROFILE, split_layers=False)
    assert len(split.parts) > len(split.metaops), "the default plan keeps every MetaOp whole here"
    assert len(whole.parts) == len(whole.metaops)
    assert whole.makespan_ms <= min(whole.baselines_ms.values()) * (1 + 1e-9)


def test_one_device_plans_every_task_in_turn():
    # one allotment per MetaOp: the local search has nothing to change (it used to fail on an empty choice)
    tasks = [TaskBatch(name="a", lengths=[1000, 2000]), TaskBatch(name="b", lengths=[3000])]
    for split_layers in (True, False):
        plan = plan_tasks(tasks, 1, PROFILE, split_layers=split_layers)
        assert plan.makespan_ms == pytest.approx(plan.baselines_ms["in_turn"])


# --- plan_task_step ----------------------------------------------------------------------------------------------


def test_spindle_beats_tasks_in_turn_on_a_skewed_step_in_the_simulator():
    lengths, task_of = skewed_batch()
    spindle, info = plan_task_step(lengths, task_of, 8, PROFILE, adapter_ranks=[16, 8, 0])
    turn, turn_info = plan_task_step(lengths, task_of, 8, PROFILE, adapter_ranks=[16, 8, 0], method="in_turn")
    for plan, meta in ((spindle, info), (turn, turn_info)):
        check_executable(plan, meta, task_of, 8)
        assert plan.meta == meta
        assert meta["simulated_ms"] == pytest.approx(step_time_ms(plan, PROFILE))
        assert meta["dataflow_ms"] <= meta["simulated_ms"] * (1 + 1e-9)  # no barrier never waits longer
    assert info["multitask"] == "spindle" and info["tasks"] == 3
    assert info["bound_ms"] <= info["makespan_ms"] and info["makespan_ms"] < info["baselines_ms"]["in_turn"]
    assert info["gap"] == pytest.approx(info["makespan_ms"] / info["bound_ms"] - 1)
    # the long task and the short ones side by side: at least one micro-batch holds two tasks' groups
    assert any(len(set(row)) > 1 for row in task_groups(spindle, task_of))
    assert step_time_ms(spindle, PROFILE) < 0.95 * step_time_ms(turn, PROFILE)


def test_waves_beside_a_long_part_gain_without_a_barrier_and_lose_with_one():
    # one 180K-token task (32 devices) beside five tasks of short sequences, 64 devices: Spindle runs the short
    # tasks on 8 devices each beside the long one. The workers (no barrier) take Spindle's estimate; the simulator
    # (a barrier per micro-batch) charges each short task's later micro-batches after the long one.
    rng = np.random.default_rng(1)
    lengths, task_of = [180_000], [0]
    for t in range(1, 6):
        lengths += rng.integers(200, 3000, size=128).tolist()
        task_of += [t] * 128
    ranks = [64] + [16] * 5
    spindle, info = plan_task_step(lengths, task_of, 64, PROFILE, adapter_ranks=ranks)
    _, turn = plan_task_step(lengths, task_of, 64, PROFILE, adapter_ranks=ranks, method="in_turn")
    check_executable(spindle, info, task_of, 64)
    assert info["dataflow_ms"] == pytest.approx(info["makespan_ms"], rel=0.03)
    assert info["dataflow_ms"] < 0.75 * turn["dataflow_ms"]
    assert info["simulated_ms"] > 1.5 * info["dataflow_ms"]  # the barrier's charge (see solver.task_steps.plan_tasks)
    assert turn["simulated_ms"] == pytest.approx(turn["dataflow_ms"], rel=0.03)  # in turn: little to overlap


def test_tasks_in_turn_are_contiguous_and_use_every_device():
    lengths, task_of = skewed_batch(1)
    plan, info = plan_task_step(lengths, task_of, 6, PROFILE, adapter_ranks=[0, 0, 0], method="in_turn")
    rows = task_groups(plan, task_of)
    assert all(len(set(row)) == 1 for row in rows)
    order = [row[0] for row in rows]
    assert order == sorted(order) and sorted(set(order)) == [0, 1, 2]
    assert [p[1:3] for p in info["parts"]] == [[0, 6]] * 3  # all 6 devices, not just the 4 of a power of two
    for t in range(3):  # each task's plan is the SP planner's on all devices
        ids = [i for i, x in enumerate(task_of) if x == t]
        alone = default_sp_planner(PROFILE)([lengths[i] for i in ids], 6, None)
        mine = [mb for mb, row in zip(plan.micro_batches, rows, strict=True) if row[0] == t]
        assert sorted(len(mb.groups) for mb in mine) == sorted(len(mb.groups) for mb in alone.micro_batches)


def test_a_fixed_split_runs_each_task_on_its_own_block():
    lengths, task_of = skewed_batch(2)
    plan, info = plan_task_step(lengths, task_of, 16, PROFILE, adapter_ranks=[0, 4, 4], method="fixed_split")
    check_executable(plan, info, task_of, 16)
    blocks = [range(first, first + size) for _, first, size, _, _ in info["parts"]]
    assert all(set(a).isdisjoint(b) for i, a in enumerate(blocks) for b in blocks[i + 1 :])
    with pytest.raises(PlanningError, match="fewest devices add up to"):
        plan_task_step([20_000, 20_000, 900], [0, 1, 2], 8, PROFILE, adapter_ranks=[0, 0, 0], method="fixed_split")


@pytest.mark.parametrize("seed", range(6))
def test_random_steps_are_executable(seed):
    rng = np.random.default_rng(500 + seed)
    n_dev = int(rng.choice([2, 3, 8, 12, 16]))
    top = 1 << (n_dev.bit_length() - 1)
    lengths, task_of = random_batch(rng, int(rng.integers(2, 5)), top * PROFILE.tokens_per_device)
    ranks = [int(rng.choice([0, 8, 64])) for _ in range(max(task_of) + 1)]
    for method in ("spindle", "in_turn"):
        plan, info = plan_task_step(lengths, task_of, n_dev, PROFILE, adapter_ranks=ranks, method=method)
        check_executable(plan, info, task_of, n_dev)
        assert plan.num_devices == n_dev and plan.seq_lengths == tuple(lengths)


@pytest.mark.parametrize("n_dev", [1, 6, 8])
def test_one_task_is_the_sp_planners_plan_on_all_devices(n_dev):
    lengths = np.random.default_rng(3).integers(100, 6000, size=30).tolist()
    plan, info = plan_task_step(lengths, [0] * 30, n_dev, PROFILE, adapter_ranks=[16])
    assert plan == default_sp_planner(PROFILE)(lengths, n_dev, None)
    assert info["parts"][0][:3] == [0, 0, n_dev]


def test_one_device_runs_every_task_one_after_another():
    lengths, task_of = [3000, 200, 4000, 100, 50], [1, 0, 2, 0, 1]
    plan, info = plan_task_step(lengths, task_of, 1, PROFILE, adapter_ranks=[0, 0, 0])
    check_executable(plan, info, task_of, 1)
    assert all(g.ranks == (0,) for mb in plan.micro_batches for g in mb.groups)


def test_the_sp_planner_gets_the_time_left_shared_between_the_parts():
    lengths, task_of = skewed_batch()
    dues, plain = [], default_sp_planner(PROFILE)

    def recording(lens, n, due):
        dues.append(due)
        return plain(lens, n, due)

    deadline = time.monotonic() + 5.0
    plan_task_step(lengths, task_of, 8, PROFILE, adapter_ranks=[0, 0, 0], sp_planner=recording, deadline=deadline)
    assert len(dues) == 3 and all(d is not None and d <= deadline for d in dues)
    assert dues[-1] == pytest.approx(deadline, abs=1e-6)  # the last part gets all that is left
    dues.clear()
    plan_task_step(lengths, task_of, 8, PROFILE, adapter_ranks=[0, 0, 0], sp_planner=recording)
    assert dues == [None, None, None]


def test_bad_inputs_are_refused_with_their_numbers():
    ok = {"adapter_ranks": [0, 0]}
    with pytest.raises(PlanningError, match="task 1 has no sequence"):
        plan_task_step([100, 200], [0, 0], 4, PROFILE, **ok)
    with pytest.raises(PlanningError, match="task_of has 3 entries for 2 sequences"):
        plan_task_step([100, 200], [0, 1, 1], 4, PROFILE, **ok)
    with pytest.raises(PlanningError, match="sequence 1 has task 2, outside 0..1"):
        plan_task_step([100, 200], [0, 2], 4, PROFILE, **ok)
    with pytest.raises(PlanningError, match="adapter_ranks needs one integer >= 0"):
        plan_task_step([100, 200], [0, 1], 4, PROFILE, adapter_ranks=[0, -8])
    with pytest.raises(PlanningError, match="method must be one of"):
        plan_task_step([100, 200], [0, 1], 4, PROFILE, method="mixed", **ok)
    with pytest.raises(PlanningError, match="at least one alive worker"):
        plan_task_step([100, 200], [0, 1], 0, PROFILE, **ok)
    # 30,000 tokens need 8 devices of 6,250: task 1's sequence does not fit on 4
    with pytest.raises(InfeasibleBatchError, match=r"task 1: sequence 1 has 30000 tokens .* 4 x 6250 = 25000"):
        plan_task_step([100, 30_000], [0, 1], 4, PROFILE, **ok)

    def wrong_size(lens, n, due):
        return default_sp_planner(PROFILE)(lens, max(1, n // 2), due)

    with pytest.raises(InvalidPlanError, match="sp_planner's plan for task"):
        plan_task_step([100, 200, 300], [0, 1, 1], 8, PROFILE, sp_planner=wrong_size, **ok)


def test_a_group_that_mixes_tasks_is_named():
    plan = Plan.for_profile(
        num_devices=2,
        seq_lengths=[100, 200, 300],
        micro_batches=[MicroBatch((Group(1, "ulysses", (0,), (0,)), Group(1, "ulysses", (1,), (1, 2))))],
        profile=PROFILE,
    )
    assert task_groups(plan, [0, 1, 1]) == [[0, 1]]
    check_single_task(plan, [0, 1, 1])
    with pytest.raises(InvalidPlanError, match=r"micro-batch 0, group 1 \(ranks 1..1\) mixes tasks \[0, 1\]"):
        check_single_task(plan, [0, 0, 1])
    with pytest.raises(InvalidPlanError, match="task_of has shape"):
        task_groups(plan, [0, 1])


def test_dataflow_time_lets_side_by_side_groups_overlap():
    # rank 0: one slow group; rank 1: two quick ones in two micro-batches; then a group of both. A barrier waits for
    # the slow group before rank 1's second one; without it the group of both starts when rank 0 is done.
    plan = Plan.for_profile(
        num_devices=2,
        seq_lengths=[6000, 100, 100, 1000],
        micro_batches=[
            MicroBatch((Group(1, "ulysses", (0,), (0,)), Group(1, "ulysses", (1,), (1,)))),
            MicroBatch((Group(1, "ulysses", (1,), (2,)),)),
            MicroBatch((Group(2, "ulysses", (0, 1), (3,)),)),
        ],
        profile=PROFILE,
    )
    slow, quick = group_time_ms([6000], 1, "ulysses", PROFILE), group_time_ms([100], 1, "ulysses", PROFILE)
    both = group_time_ms([1000], 2, "ulysses", PROFILE)
    assert dataflow_time_ms(plan, PROFILE) == pytest.approx(slow + both)
    assert step_time_ms(plan, PROFILE) == pytest.approx(slow + quick + both)


# --- StepPlanner and the fallback ---------------------------------------------------------------------------------


def test_step_planner_plans_a_multi_task_step():
    lengths, task_of = skewed_batch()
    with StepPlanner(PROFILE, PlannerConfig(time_limit_s=2.0, isolate=False)) as planner:
        got = planner.plan(lengths, 8, task_of=task_of, adapter_ranks=[16, 8, 0])
        turn = planner.plan(lengths, 8, task_of=task_of, adapter_ranks=[16, 8, 0], task_method="in_turn")
        bad = planner.plan([100, 30_000], 4, task_of=[0, 1], adapter_ranks=[0, 0])
    assert got.error is None and got.status == "spindle" and got.bound_ms == 0.0 and got.budget_s == 2.0
    check_executable(got.plan, got.plan.meta, task_of, 8)
    assert got.predicted_ms == pytest.approx(step_time_ms(got.plan, PROFILE))
    assert got.predicted_ms <= got.baselines_ms["in_turn"]
    assert got.plan.meta["in_turn_dataflow_ms"] >= got.plan.meta["dataflow_ms"]
    assert got.solve_s < 10 * 2.0  # a hang, not speed (speed: benchmarks/measured/multi_task.py)
    assert turn.status == "in_turn" and turn.baselines_ms == {"in_turn": turn.predicted_ms}
    assert all(len(set(row)) == 1 for row in task_groups(turn.plan, task_of))
    assert bad.plan is None and bad.status == "infeasible" and "task 1" in bad.error


def test_the_heuristic_fallback_plans_a_multi_task_step():
    lengths, task_of = skewed_batch()
    got = heuristic_plan(PROFILE, lengths, 8, None, task_of=task_of, adapter_ranks=[16, 8, 0])
    assert got.status == "fallback" and got.predicted_ms == pytest.approx(step_time_ms(got.plan, PROFILE))
    check_executable(got.plan, got.plan.meta, task_of, 8)
    missing = heuristic_plan(PROFILE, lengths, 8, None, task_of=[0] * len(lengths), adapter_ranks=[0, 0, 0])
    assert missing.status == "infeasible" and "task 1 has no sequence" in missing.error


def test_tasks_with_pipeline_stages_or_a_static_layout_are_refused():
    cfg = PlannerConfig(time_limit_s=1.0, isolate=False)
    with pytest.raises(PlanningError, match="pipeline stages with several tasks are not supported yet"):
        StepPlanner(PROFILE, cfg, pipeline_stages=2).plan([100, 200], 4, task_of=[0, 1], adapter_ranks=[0, 0])
    with pytest.raises(PlanningError, match="static layout"):
        StepPlanner(PROFILE, cfg, static=("ulysses", 2)).plan([100, 200], 4, task_of=[0, 1], adapter_ranks=[0, 0])
    with pytest.raises(PlanningError, match="pipeline stages with several tasks"):
        heuristic_plan(PROFILE, [100, 200], 4, None, 2, task_of=[0, 1], adapter_ranks=[0, 0])


@pytest.mark.parametrize("barrier", [False, True])
def test_the_step_runs_the_tasks_in_turn_where_they_are_faster_in_the_workers_time_model(monkeypatch, barrier):
    """Spindle's choice is made in its own estimates; the executable plan is then timed as the workers run it
    (barrier-free on replicated workers, a barrier per micro-batch with sharded state) against the tasks in turn,
    and the faster one runs (seen on 2 workers: the Spindle plan 7 % slower than in turn)."""
    import flexorch.solver.task_steps as task_steps

    real = task_steps.plan_task_step
    key = "simulated_ms" if barrier else "dataflow_ms"

    def slower_spindle(*args, method, **kw):  # make Spindle's executable plan look 2x slower in one time model
        plan, info = real(*args, method=method, **kw)
        if method == "spindle":
            info = {**info, key: 2 * info[key] + 1.0}
        return plan, info

    monkeypatch.setattr(task_steps, "plan_task_step", slower_spindle)
    lengths, task_of = skewed_batch()
    with StepPlanner(PROFILE, PlannerConfig(time_limit_s=1.0, isolate=False)) as planner:
        got = planner.plan(lengths, 8, task_of=task_of, adapter_ranks=[16, 8, 0], task_barrier=barrier)
        other = planner.plan(lengths, 8, task_of=task_of, adapter_ranks=[16, 8, 0], task_barrier=not barrier)
    assert got.status == "spindle-in_turn" and got.plan.meta["multitask"] == "in_turn"
    assert "tasks in turn:" in got.plan.meta["note"] and got.plan.meta[f"spindle_{key}"] > 0
    check_executable(got.plan, got.plan.meta, task_of, 8)
    assert other.status == "spindle"  # the other time model still prefers Spindle's plan
