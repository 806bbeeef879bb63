"""Spindle's multi-task planner (flexorch/solver/multitask; arXiv 2409.03365): continuous allocation, its bound,
bi-point discretisation, wavefront schedules, plan validation, baselines. Pure and fast (no Ray, no torch)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time

import numpy as np
import pytest

from flexorch.solver.cost_model import group_overhead_ms, seq_times_ms
from flexorch.solver.errors import InvalidPlanError, PlanningError
from flexorch.solver.multitask import (
    MetaOp,
    MultiTaskPlan,
    TaskBatch,
    bi_point,
    build_metaops,
    continuous_allocation,
    devices_for_time,
    layer_ms_at,
    plan_metaops,
    plan_tasks,
)
from flexorch.solver.multitask.allocation import hull
from flexorch.solver.multitask.plan import Part, Wave, waves_of
from flexorch.solver.multitask.sp_estimate import layer_times_ms
from flexorch.solver.profiles import get_profile
from tests.paths import BENCHMARKS

PROFILE = get_profile("gpt-7b-a100")


def random_metaop(rng, task: int, num_devices: int, layers: int, level: int = 0, allow_inf: bool = True) -> MetaOp:
    """T(n) = a/n^alpha + b (sublinear speedup), sometimes infeasible on the fewest counts, sometimes jagged."""
    counts = np.array([1 << k for k in range(num_devices.bit_length())], dtype=float)
    t = rng.uniform(1, 20) / counts ** rng.uniform(0.4, 1.0) + rng.uniform(0.0, 2.0)
    t *= rng.uniform(0.9, 1.1, size=t.size)  # jagged: some counts end up dominated
    t = np.minimum.accumulate(t)
    if allow_inf and rng.random() < 0.3:
        t[: rng.integers(1, 3)] = math.inf
    return MetaOp(task=task, level=level, layers=layers, layer_ms=tuple(t), name=f"t{task}/{level}")


# --- the time curves --------------------------------------------------------------------------------------------


def test_layer_times_follow_the_cost_model_and_never_rise():
    one = layer_times_ms([3000], 8, PROFILE)
    # one sequence on one device: its time plus one group overhead, per layer
    expected = (
        seq_times_ms(np.array([3000]), 1, "ulysses", PROFILE)[0] + group_overhead_ms(1, "ulysses", PROFILE)
    ) / 32
    assert one[0] == pytest.approx(expected)
    many = layer_times_ms(np.random.default_rng(0).integers(100, 20_000, size=200), 64, PROFILE)
    assert all(b <= a for a, b in zip(many, many[1:], strict=False))
    assert many[-1] < many[0] / 8  # 200 sequences spread well over 64 devices
    long = layer_times_ms([100_000, 500], 64, PROFILE)  # 100K tokens need 16 devices of 6,250
    assert all(math.isinf(t) for t in long[:4]) and math.isfinite(long[4])
    ranked = layer_times_ms([3000] * 8, 8, PROFILE, adapter_rank=256)
    assert all(r > o for r, o in zip(ranked, layer_times_ms([3000] * 8, 8, PROFILE), strict=True))


def test_a_task_that_does_not_fit_is_refused_with_its_numbers():
    with pytest.raises(PlanningError, match="300000 tokens"):
        build_metaops([TaskBatch(name="huge", lengths=[300_000])], 16, PROFILE)
    with pytest.raises(PlanningError, match="at least one sequence"):
        TaskBatch(name="empty", lengths=[])


# --- continuous allocation ---------------------------------------------------------------------------------------


def _brute_force_makespan(metaops, num_devices: int, steps: int) -> float:
    """min over a grid of real allocations with sum n = N of max_m L_m T_m(n_m) (Spindle's problem)."""
    ranges = [(1e-6, hull(m).counts[0]) for m in metaops]  # below the cheapest count: time-sharing it
    best = math.inf
    grids = [np.linspace(lo, hi, steps) for lo, hi in ranges[:-1]]
    for ns in itertools.product(*grids):
        last = num_devices - sum(ns)
        lo, hi = ranges[-1]
        if not lo <= last <= hi:
            continue
        span = max(m.layers * layer_ms_at(m, n) for m, n in zip(metaops, (*ns, last), strict=True))
        best = min(best, span)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_continuous_allocation_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n_tasks = 2 if seed < 3 else 3
    metaops = [random_metaop(rng, t, 16, int(rng.integers(2, 40)), allow_inf=False) for t in range(n_tasks)]
    alloc = continuous_allocation(metaops, 16)
    brute = _brute_force_makespan(metaops, 16, 1500 if n_tasks == 2 else 120)
    assert alloc.makespan_ms <= brute * (1 + 1e-9)
    assert alloc.makespan_ms >= brute * (1 - 0.02), (alloc.makespan_ms, brute)  # the grid's resolution
    fastest = max(m.layers * hull(m).tau[0] for m in metaops)
    if alloc.makespan_ms > fastest * (1 + 1e-9):  # not set by one task alone: the devices add up to N
        assert sum(alloc.task_devices) == pytest.approx(16)
    for m, s in zip(metaops, alloc.shares, strict=True):
        assert s.devices <= s.n_hi + 1e-9
        if s.devices < hull(m).counts[-1]:  # cheap enough to be done early: time-sharing its cheapest count
            assert s.n_lo == s.n_hi == hull(m).counts[-1]
        else:
            assert s.n_lo <= s.devices + 1e-9
        # Theorem 1: every MetaOp ends exactly at C*, on n* = n_m(C*)
        assert s.time_ms == pytest.approx(alloc.makespan_ms)
        assert m.layers * layer_ms_at(m, s.devices) == pytest.approx(alloc.makespan_ms)
        assert devices_for_time(m, alloc.makespan_ms) == pytest.approx(s.devices)


def test_a_task_that_alone_sets_the_makespan_gets_what_it_needs():
    slow = MetaOp(task=0, level=0, layers=10, layer_ms=(100.0, 60.0, 40.0, 40.0))  # no faster on 8 than on 4
    quick = MetaOp(task=1, level=0, layers=10, layer_ms=(1.0, 0.6, 0.4, 0.3))
    alloc = continuous_allocation([slow, quick], 8)
    assert alloc.makespan_ms == pytest.approx(400.0)  # slow on 4 devices, its fastest
    assert sum(alloc.task_devices) < 8
    plan = plan_metaops([slow, quick], 8)
    assert plan.makespan_ms == pytest.approx(400.0) and plan.gap < 1e-9


# --- the bound against every wave schedule ----------------------------------------------------------------------


def _best_wave_schedule(metaops, num_devices: int) -> float:
    """Exhaustive: the least makespan of any schedule in waves (each wave: at most one part per task, l layers on a
    valid count, counts adding up to <= N; a wave lasts as long as its longest part), by a DP over layers left."""
    counts = [c for c in metaops[0].counts]

    @functools.cache
    def best(left: tuple[int, ...]) -> float:
        if not any(left):
            return 0.0
        choices = []
        for m, rem in zip(metaops, left, strict=True):
            opts = [None] + [(c, ell) for c in counts if c >= m.min_count for ell in range(1, rem + 1)]
            choices.append(opts)
        out = math.inf
        for pick in itertools.product(*choices):
            if all(p is None for p in pick) or sum(p[0] for p in pick if p) > num_devices:
                continue
            wave = max(m.time_ms(p[0], p[1]) for m, p in zip(metaops, pick, strict=True) if p)
            nxt = tuple(rem - (p[1] if p else 0) for rem, p in zip(left, pick, strict=True))
            out = min(out, wave + best(nxt))
        return out

    return best(tuple(m.layers for m in metaops))


@pytest.mark.parametrize("seed", range(12))
def test_the_bound_is_below_every_wave_schedule(seed):
    rng = np.random.default_rng(100 + seed)
    n_dev = 4 if seed % 2 else 8
    n_tasks = 2 if seed < 6 else 3
    metaops = [random_metaop(rng, t, n_dev, int(rng.integers(1, 4))) for t in range(n_tasks)]
    bound = continuous_allocation(metaops, n_dev).makespan_ms
    optimum = _best_wave_schedule(metaops, n_dev)
    assert bound <= optimum * (1 + 1e-9), (bound, optimum)
    plan = plan_metaops(metaops, n_dev)
    assert bound <= plan.makespan_ms * (1 + 1e-9)
    # the planner's event-driven schedule is a valid schedule too; it is seldom far from the best wave schedule
    assert plan.makespan_ms <= optimum * 1.5


def test_the_bound_is_tight_when_the_devices_split_exactly():
    # two identical tasks, perfect speedup (16 device-ms per layer): 2 * 4 * 16 / 8 = 16 ms, 4 devices each
    ops = [MetaOp(task=t, level=0, layers=4, layer_ms=(16.0, 8.0, 4.0, 2.0)) for t in range(2)]
    plan = plan_metaops(ops, 8)
    assert plan.bound_ms == pytest.approx(16.0) and plan.makespan_ms == pytest.approx(16.0) and plan.gap < 1e-9


# --- discretisation and plans ------------------------------------------------------------------------------------


def _running_devices_never_exceed(plan: MultiTaskPlan) -> None:
    events = sorted({p.start_ms for p in plan.parts})
    for t in events:
        live = [p for p in plan.parts if p.start_ms <= t < p.end_ms]
        assert sum(len(p.devices) for p in live) <= plan.num_devices
        used = [d for p in live for d in p.devices]
        assert len(used) == len(set(used))


@pytest.mark.parametrize("seed", range(8))
def test_bi_point_covers_all_layers_and_plans_hold(seed):
    rng = np.random.default_rng(200 + seed)
    n_dev = int(rng.choice([8, 16, 32, 48]))
    metaops = []
    for t in range(int(rng.integers(2, 6))):
        metaops.append(random_metaop(rng, t, n_dev, int(rng.integers(1, 33))))
        if rng.random() < 0.3:  # a task with its own head layers: a chain of two MetaOps
            metaops.append(random_metaop(rng, t, n_dev, int(rng.integers(1, 5)), level=1))
    alloc = continuous_allocation(metaops, n_dev)
    pieces = bi_point(tuple(metaops), alloc)
    for m, s in zip(metaops, alloc.shares, strict=True):
        mine = [p for p in pieces if (p.task, p.level) == (m.task, m.level)]
        assert sum(p.layers for p in mine) == m.layers
        assert {p.count for p in mine} <= {s.n_lo, s.n_hi}
        lo = sum(p.layers for p in mine if p.count == s.n_lo and s.n_lo != s.n_hi)
        assert abs(lo - s.lo_fraction * m.layers) <= 0.5 + 1e-9
    plan = plan_metaops(metaops, n_dev)
    for p in plan.parts:
        d = len(p.devices)
        assert d & (d - 1) == 0 and p.devices[0] % d == 0 and p.devices[-1] < n_dev
    _running_devices_never_exceed(plan)
    assert plan.makespan_ms <= min(plan.baselines_ms.values()) * (1 + 1e-9)


def _two_task_plan() -> MultiTaskPlan:
    """Two tasks of 2 layers (4, 2, 1 ms per layer on 1, 2, 4 devices) on 4 devices: each on 2 devices, 4 ms."""
    ops = tuple(MetaOp(task=t, level=0, layers=2, layer_ms=(4.0, 2.0, 1.0), name=f"t{t}") for t in range(2))
    parts = (Part(0, 0, 2, (0, 1), 0.0, 4.0), Part(1, 0, 2, (2, 3), 0.0, 4.0))
    bound = continuous_allocation(ops, 4).makespan_ms
    assert bound == pytest.approx(4.0)
    return MultiTaskPlan(num_devices=4, metaops=ops, waves=waves_of(parts), makespan_ms=4.0, bound_ms=bound)


def _replan(plan: MultiTaskPlan, *parts: Part, **changes) -> MultiTaskPlan:
    return dataclasses.replace(plan, waves=waves_of(parts), **changes)


def test_bad_plans_are_refused_with_a_message():
    plan = _two_task_plan()
    a, b = sorted(plan.parts, key=lambda p: p.task)
    assert plan.waves == (Wave(0.0, (a, b)),) and plan.waves[0].time_ms == 4.0
    with pytest.raises(InvalidPlanError, match="exactly once"):
        _replan(plan, a, dataclasses.replace(b, layers=1, time_ms=2.0))
    with pytest.raises(InvalidPlanError, match="not an aligned block"):
        _replan(plan, a, dataclasses.replace(b, devices=(1, 2)))
    with pytest.raises(InvalidPlanError, match="not an aligned block"):
        _replan(plan, a, dataclasses.replace(b, devices=(4, 5)))
    with pytest.raises(InvalidPlanError, match="the MetaOp says 4.000 ms"):
        _replan(plan, a, dataclasses.replace(b, time_ms=3.0))
    with pytest.raises(InvalidPlanError, match=r"devices \[0, 1\].* at once"):
        _replan(plan, a, dataclasses.replace(b, devices=a.devices))
    with pytest.raises(InvalidPlanError, match="one after another"):  # task 0's two halves overlap in time
        half = dataclasses.replace(a, layers=1, time_ms=2.0)
        _replan(
            plan,
            half,
            dataclasses.replace(half, devices=(2, 3), start_ms=1.0),
            dataclasses.replace(b, start_ms=4.0),
            makespan_ms=8.0,
        )
    with pytest.raises(InvalidPlanError, match="the last part ends"):
        _replan(plan, a, b, makespan_ms=5.0)
    with pytest.raises(InvalidPlanError, match="bound 5.000 ms is above"):
        _replan(plan, a, b, bound_ms=5.0)
    with pytest.raises(InvalidPlanError, match="does not exist"):
        _replan(plan, a, dataclasses.replace(b, metaop=1))
    with pytest.raises(InvalidPlanError, match="at least one part"):
        _replan(plan)
    chain = [MetaOp(task=0, level=lv, layers=1, layer_ms=(2.0, 1.0)) for lv in (0, 1)]
    first, second = plan_metaops(chain, 2).parts
    with pytest.raises(InvalidPlanError, match="level 0 runs after level 1"):
        _replan(
            plan_metaops(chain, 2), dataclasses.replace(first, start_ms=1.0), dataclasses.replace(second, start_ms=0.0)
        )


# --- real batches: baselines and the gain ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_never_worse_than_the_baselines_on_real_lengths(seed):
    rng = np.random.default_rng(300 + seed)
    n_dev = 64 if seed % 2 else 16
    tasks = [
        TaskBatch(
            name=f"t{i}",
            lengths=rng.lognormal(7, 1.2, size=int(rng.integers(8, 128))).clip(16, 40_000),
            adapter_rank=int(rng.choice([0, 8, 64])),
            head_layers=int(rng.choice([0, 0, 2])),
        )
        for i in range(int(rng.integers(2, 6)))
    ]
    plan = plan_tasks(tasks, n_dev, PROFILE)
    assert plan.makespan_ms <= min(plan.baselines_ms.values()) * (1 + 1e-9)
    assert plan.bound_ms <= plan.makespan_ms * (1 + 1e-9)
    assert plan.gap == pytest.approx(plan.makespan_ms / plan.bound_ms - 1)
    _running_devices_never_exceed(plan)


def test_one_long_task_and_several_short_ones_gain_over_both_baselines():
    rng = np.random.default_rng(1)
    tasks = [TaskBatch(name="long", lengths=[180_000], adapter_rank=64)] + [
        TaskBatch(name=f"short{i}", lengths=rng.integers(200, 3000, size=128), adapter_rank=16) for i in range(5)
    ]
    plan = plan_tasks(tasks, 64, PROFILE)
    assert plan.method == "spindle"
    assert plan.baselines_ms["in_turn"] / plan.makespan_ms > 1.3
    assert plan.baselines_ms["fixed_split"] / plan.makespan_ms > 1.3
    assert plan.gap < 0.15


def test_plans_256_devices_and_8_tasks_better_than_every_baseline():
    # its speed is reported by benchmarks/sim/multi_task.py (256 x 8 row); here a bound ten times that catches a hang
    rng = np.random.default_rng(5)
    tasks = [
        TaskBatch(
            name=f"t{i}",
            lengths=rng.lognormal(7.5, 1.3, size=int(rng.choice([64, 256, 512]))).clip(16, 200_000),
            adapter_rank=int(rng.choice([8, 64, 256])),
        )
        for i in range(8)
    ]
    started = time.perf_counter()
    plan = plan_tasks(tasks, 256, PROFILE)
    assert time.perf_counter() - started < 30.0
    assert plan.makespan_ms <= min(plan.baselines_ms.values())


def test_the_benchmark_quick_run_prints_its_table(capsys):
    import importlib.util

    path = BENCHMARKS / "sim" / "multi_task.py"
    spec = importlib.util.spec_from_file_location("multi_task_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--quick"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 64 | 3 |")]
    assert len(rows) == 1 and "spindle" in rows[0]
