"""Several tasks in one step as ONE executable ``Plan``: Spindle's wavefront schedule (arXiv 2409.03365, §4.3)
with an SP plan per part (FlexSP, arXiv 2412.01523), pure.

    lengths, task_of, adapter ranks, N devices
      -> one TaskBatch per task -> Spindle's MultiTaskPlan, every task whole (split_layers=False: one part per task)
      -> per part: an SP plan of the task's sequences on the part's block (``sp_planner``), ranks shifted to it
      -> the parts' micro-batches placed in wave order into one ``flexorch.solver.plan.Plan``

Why one ``Plan``: the workers already execute one. Each rank runs its groups in micro-batch order; a group waits
only on its own ranks (its collectives), so parts on disjoint blocks run side by side as the schedule has them.
Every group holds sequences of one task (the worker activates that task's adapter for the group:
:func:`task_groups`, :func:`check_single_task`). A task's layers are never split between two device sets (the
bi-point layer split would move activations between them mid-model; not built), hence ``split_layers=False``.

**Composition.** Parts are taken in wave order (start time, then first rank). A part's micro-batches go to
consecutive micro-batch slots from the first slot after every slot any rank of its block used before; so groups of
one slot have disjoint ranks (parts that share a rank get disjoint slots) and each rank meets the parts in the
order the schedule starts them there. Slots are never skipped, so no micro-batch is empty.

**Non-power-of-two N.** Spindle's blocks lie in the largest power of two <= N (``top``); a part on all of ``top``
gets all N devices (nothing else runs beside it; its SP plan places groups on the rest). One task: the plan is
``sp_planner``'s on all N devices.

**Time.** ``plan.meta`` carries Spindle's own numbers (its per-layer estimates, ``sp_estimate.py``): the parts'
start and time, the bound C*, the makespan, the gap, the baselines; and two times of the executable plan under
FlexSP's cost model: ``simulated_ms`` (``flexorch.solver.simulator.step_time_ms``: micro-batches one after another,
each as long as its slowest group, i.e. a barrier between micro-batches) and ``dataflow_ms`` (:func:`dataflow_time_ms`:
each group starts when its ranks are free, no barrier). Replicated workers run the dataflow schedule; sharded ones
(FSDP: every rank runs every micro-batch, with world-wide all-gathers per layer) are closer to the barrier one.
Parts side by side whose micro-batches differ in time make ``simulated_ms`` exceed ``dataflow_ms`` (a long part's
one micro-batch beside a short part's several costs the long one plus all but the first of the short ones).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from flexorch.solver.baselines import baseline_plans
from flexorch.solver.cost_model import group_time_ms
from flexorch.solver.errors import InfeasibleBatchError, InvalidPlanError, PlanningError
from flexorch.solver.multitask.allocation import continuous_allocation
from flexorch.solver.multitask.baselines import fixed_split_parts, in_turn_parts
from flexorch.solver.multitask.metaop import TaskBatch, build_metaops
from flexorch.solver.multitask.plan import Part
from flexorch.solver.multitask.planner import plan_metaops
from flexorch.solver.plan import Group, MicroBatch, Plan
from flexorch.solver.profiles import Profile
from flexorch.solver.simulator import micro_batch_times_ms, step_time_ms
from flexorch.solver.validation import check_batch, check_num_devices, largest_degree

__all__ = [
    "METHODS",
    "SpPlanner",
    "check_single_task",
    "dataflow_time_ms",
    "default_sp_planner",
    "plan_task_step",
    "task_groups",
]

METHODS = ("spindle", "in_turn", "fixed_split")
"""``spindle``: Spindle's schedule, whole tasks; ``in_turn``: each task's SP plan on all devices, task 0 first (the
baseline a measured run compares against); ``fixed_split``: each task on its own block for the whole step."""

SpPlanner = Callable[[np.ndarray, int, "float | None"], Plan]
"""``sp_planner(lengths, n, deadline)``: an SP plan of one task's sequences (ids 0..k-1) on n devices, by
``deadline`` (a ``time.monotonic()`` value, or None: no limit)."""


def default_sp_planner(profile: Profile) -> SpPlanner:
    """The MILP-free SP planner: FlexSP's BatchAda (best homogeneous layout; ``solver.baselines``), as
    ``step_planner.heuristic_plan`` uses."""

    def plan(lengths, n: int, deadline: float | None = None) -> Plan:
        return baseline_plans(lengths, n, profile, deadline=deadline)["batchada"]

    return plan


def plan_task_step(
    lengths,
    task_of,
    num_devices: int,
    profile: Profile,
    *,
    adapter_ranks,
    method: str = "spindle",
    sp_planner: SpPlanner | None = None,
    deadline: float | None = None,
) -> tuple[Plan, dict]:
    """One step of several tasks as one validated ``Plan`` whose every group holds one task's sequences, and the
    dict put in ``plan.meta`` (see the module docstring). ``task_of[i]``: the task (0..T-1) of sequence i;
    ``adapter_ranks[t]``: task t's LoRA rank (0: none), T = len(adapter_ranks); every task needs a sequence.

    ``sp_planner(lengths, n, deadline)`` plans one part (default: :func:`default_sp_planner`); with ``deadline``
    (``time.monotonic()``) each call gets a share of the time left (``_sub_plans``), else None. Meta keys:
    ``multitask`` (the method), ``tasks``, ``parts`` ([task, first rank, size, start_ms, time_ms] in wave order,
    Spindle's estimates), ``bound_ms`` (C*), ``makespan_ms`` (Spindle's estimate of this schedule), ``gap``,
    ``baselines_ms`` (in turn, fixed split in Spindle's model; None where impossible), ``simulated_ms``,
    ``dataflow_ms``, ``solve_s``; for 'spindle' also ``schedule`` (the search's answer, a baseline where one was
    better) and ``note``."""
    t0 = time.perf_counter()
    if method not in METHODS:
        raise PlanningError(f"method must be one of {METHODS}, got {method!r}")
    arr, tasks, ranks = _check_inputs(lengths, task_of, num_devices, profile, adapter_ranks)
    n = int(num_devices)
    sp_planner = default_sp_planner(profile) if sp_planner is None else sp_planner
    ids = [np.flatnonzero(tasks == t) for t in range(len(ranks))]
    batches = [
        TaskBatch(name=f"task{t}", lengths=tuple(arr[i].tolist()), adapter_rank=r)
        for t, (i, r) in enumerate(zip(ids, ranks, strict=True))
    ]
    metaops = build_metaops(batches, n, profile)
    info: dict = {"multitask": method, "tasks": len(ranks)}
    parts, bound, baselines = _schedule(method, metaops, n, len(ranks), info)
    if len(parts) != len(ranks):  # whole tasks: one part each (build_metaops gives one MetaOp per task here)
        raise InvalidPlanError(f"expected one part per task ({len(ranks)}), got {len(parts)}")
    blocks = _blocks(parts, n)
    subs = _sub_plans(blocks, ids, arr, sp_planner, deadline)
    micro_batches = _compose(blocks, subs, ids, n, profile)
    makespan = _end(parts)
    info.update(
        parts=[[p.task, b[0], len(b), float(p.start_ms), float(p.time_ms)] for p, b in blocks],
        bound_ms=bound,
        makespan_ms=float(makespan),
        gap=float(makespan / bound - 1.0) if bound > 0 else 0.0,
        baselines_ms={k: float(v) if math.isfinite(v) else None for k, v in baselines.items()},
    )
    plan = Plan.for_profile(num_devices=n, seq_lengths=arr, micro_batches=micro_batches, profile=profile, meta=info)
    check_single_task(plan, tasks)
    info["simulated_ms"] = step_time_ms(plan, profile)
    info["dataflow_ms"] = dataflow_time_ms(plan, profile)
    info["solve_s"] = time.perf_counter() - t0
    plan.meta.update(info)
    return plan, dict(info)


def _schedule(method: str, metaops, n: int, num_tasks: int, info: dict) -> tuple[list[Part], float, dict]:
    """(the parts in wave order, the bound C*, the baselines' makespans) of the tasks' metaops by `method`; for
    'spindle' the schedule Spindle's search chose and its note go into `info`."""
    if method == "spindle":
        mt = plan_metaops(metaops, n, split_layers=False)
        parts, bound, baselines = mt.parts, float(mt.bound_ms), dict(mt.baselines_ms)
        info["schedule"] = mt.method  # 'spindle', or the baseline Spindle's search fell back to
        info["note"] = mt.note
    else:
        bound = float(continuous_allocation(metaops, n).makespan_ms)
        split = fixed_split_parts(metaops, n)
        turn = in_turn_parts(metaops, n)
        baselines = {"in_turn": _end(turn), "fixed_split": _end(split) if split else math.inf}
        if method == "fixed_split" and split is None:
            raise PlanningError(
                f"a fixed split cannot run these {num_tasks} tasks at once on {n} devices: their fewest devices "
                f"add up to {sum(m.min_count for m in metaops)}; use method='spindle' or 'in_turn'"
            )
        parts = split if method == "fixed_split" else turn
    return parts, bound, baselines


def task_groups(plan: Plan, task_of) -> list[list[int]]:
    """Per micro-batch, per group, the task whose sequences the group runs (InvalidPlanError where it mixes)."""
    tasks = np.asarray(task_of)
    if tasks.shape != (len(plan.seq_lengths),):
        raise InvalidPlanError(f"task_of has shape {tasks.shape}; the plan has {len(plan.seq_lengths)} sequences")
    out = []
    for mi, mb in enumerate(plan.micro_batches):
        row = []
        for gi, g in enumerate(mb.groups):
            mine = sorted(set(tasks[list(g.seq_ids)].tolist()))
            if len(mine) != 1:
                raise InvalidPlanError(
                    f"micro-batch {mi}, group {gi} (ranks {g.ranks[0]}..{g.ranks[-1]}) mixes tasks {mine} "
                    f"(sequences {list(g.seq_ids)[:8]}): a group runs one task's adapter"
                )
            row.append(int(mine[0]))
        out.append(row)
    return out


def check_single_task(plan: Plan, task_of) -> None:
    """Raise InvalidPlanError naming the first group whose sequences belong to more than one task."""
    task_groups(plan, task_of)


def dataflow_time_ms(plan: Plan, profile: Profile) -> float:
    """The plan's time without barriers between micro-batches: each group (``group_time_ms``) starts when all its
    ranks have finished their previous group, in micro-batch order (what replicated workers run)."""
    free = np.zeros(plan.num_devices)
    for mb in plan.micro_batches:
        for g in mb.groups:
            r = list(g.ranks)
            lengths = [plan.seq_lengths[i] for i in g.seq_ids]
            free[r] = free[r].max() + group_time_ms(lengths, g.degree, g.kind, profile)
    return float(free.max())


def _end(parts) -> float:
    return max(p.end_ms for p in parts)


def _check_inputs(lengths, task_of, num_devices, profile, adapter_ranks):
    """(lengths as int64, task_of as int64, adapter ranks) after every check, each error naming the numbers."""
    n = check_num_devices(num_devices)
    try:
        ranks = [int(r) for r in adapter_ranks] if adapter_ranks is not None else []
    except (TypeError, ValueError):
        ranks = []
    if not ranks or any(r < 0 for r in ranks) or any(r != a for r, a in zip(ranks, adapter_ranks, strict=True)):
        raise PlanningError(f"adapter_ranks needs one integer >= 0 per task (0: no adapter), got {adapter_ranks!r}")
    tasks = np.asarray(task_of)
    if tasks.ndim != 1 or tasks.size != len(lengths):
        raise PlanningError(f"task_of has {tasks.size} entries for {len(lengths)} sequences: one task per sequence")
    if tasks.size and not np.issubdtype(tasks.dtype, np.integer):
        raise PlanningError(f"task_of must hold task indices (integers), got dtype {tasks.dtype}")
    tasks = tasks.astype(np.int64)
    out = np.flatnonzero((tasks < 0) | (tasks >= len(ranks)))
    if out.size:
        i = int(out[0])
        raise PlanningError(
            f"sequence {i} has task {int(tasks[i])}, outside 0..{len(ranks) - 1} (adapter_ranks names "
            f"{len(ranks)} tasks)"
        )
    try:
        arr = check_batch(lengths, n, profile)
    except InfeasibleBatchError as e:
        s = np.asarray(lengths, dtype=np.int64)
        i = int(np.argmax(s))
        raise InfeasibleBatchError(f"task {int(tasks[i])}: {e}") from e
    absent = sorted(set(range(len(ranks))) - set(tasks.tolist()))
    if absent:
        raise PlanningError(
            f"task {absent[0]} has no sequence in this step (tasks absent: {absent}, of {len(ranks)} in "
            "adapter_ranks): give every task at least one sequence, or plan the step without it"
        )
    return arr, tasks, ranks


def _blocks(parts, n: int) -> list[tuple[Part, range]]:
    """Parts in wave order with the ranks each runs on: its block, or all N when it spans the largest power of two
    (one task: all N)."""
    top = largest_degree(n)
    ordered = sorted(parts, key=lambda p: (p.start_ms, p.devices[0]))
    whole = len(parts) == 1
    return [
        (p, range(n) if whole or len(p.devices) == top else range(p.devices[0], p.devices[-1] + 1)) for p in ordered
    ]


def _sub_plans(blocks, ids, arr, sp_planner, deadline) -> list[Plan]:
    """Each part's SP plan on its block's size; with `deadline`, the time left shared by the parts still to plan:
    half of it equally, half in proportion to their sequences (a part of a few sequences solves in milliseconds
    and hands the rest on; one of many needs more)."""
    out = []
    left = sum(ids[p.task].size for p, _ in blocks)
    for k, (p, block) in enumerate(blocks):
        mine = ids[p.task]
        due = None
        if deadline is not None:
            now = time.monotonic()
            due = now + max(0.0, deadline - now) * (0.5 / (len(blocks) - k) + 0.5 * mine.size / left)
        left -= mine.size
        sub = sp_planner(arr[mine], len(block), due)
        if sub.num_devices != len(block) or tuple(sub.seq_lengths) != tuple(arr[mine].tolist()):
            raise InvalidPlanError(
                f"sp_planner's plan for task {p.task} is for {sub.num_devices} devices and "
                f"{len(sub.seq_lengths)} sequences; asked for {len(block)} devices and {mine.size} sequences"
            )
        out.append(sub)
    return out


def _compose(blocks, subs, ids, n: int, profile: Profile) -> list[MicroBatch]:
    """The parts' micro-batches in slots (module docstring): ranks shifted to the block, ids to the step's batch.
    A part on fewer than N devices runs its micro-batches slowest first (their order within a part changes
    nothing the step computes): parts that start in one slot then pair slow with slow, the least sum of slot
    maxima, which a barrier per micro-batch pays. A part on all N keeps ``sp_planner``'s order."""
    slots: list[list[Group]] = []
    last = np.full(n, -1, dtype=np.int64)  # the last slot each rank was given to
    for (p, block), sub in zip(blocks, subs, strict=True):
        first = int(last[block.start : block.stop].max()) + 1
        mine = ids[p.task]
        times = micro_batch_times_ms(sub, profile)
        order = sorted(range(len(times)), key=lambda j: -times[j] if len(block) < n else j)
        for j, mb in enumerate(sub.micro_batches[k] for k in order):
            if first + j == len(slots):
                slots.append([])
            slots[first + j].extend(
                Group(
                    g.degree,
                    g.kind,
                    tuple(r + block.start for r in g.ranks),
                    tuple(int(mine[s]) for s in g.seq_ids),
                )
                for g in mb.groups
            )
        last[block.start : block.stop] = first + len(sub.micro_batches) - 1
    return [MicroBatch(tuple(groups)) for groups in slots]
