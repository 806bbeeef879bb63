"""What the plan viewer shows, computed from a run's step records (pure Python; no Ray, no server).

:func:`read_run` reads ``RUN_DIR/steps.jsonl`` and validates each record against ``flexorch.step/4``; it keeps the
good records before a malformed line and reports that line's error, so the page shows both. :func:`step_view`
turns one record into the picture's bars: one bar per SP group with its ranks, predicted start and length (the
cost model's timeline) and, for trained steps, measured start and length (slowest member of the group, from
each rank's per-micro-batch timings). A pipelined step (``pipeline`` set) has no groups; its ``pipeline`` view
has one bar per forward and backward op of each stage and unit, predicted (the pipeline simulator's schedule) and,
for trained steps, measured (from the ops its stage's ranks reported).

A step of several ``[[tasks]]`` (its record has ``tasks``) also gets each group's task and the tasks' legend
(:func:`task_view`): the record does not say which task each sequence is, but a batch holds ``tasks[name].docs``
documents of each task in task order (``TaskStreams._combine``: first all of task 0's, then task 1's, ...), so
sequence i is the task whose cumulative range of documents covers i (:func:`seq_tasks`).

Worker speeds (:func:`rank_speeds`): each rank's relative speed, from what the worker showed (a trained record's
``ranks[i].speed``, the driver's estimate: ``solver.worker_speeds``) or else what the plan was priced with
(``plan.topology.speeds``); the page shades a rank below ``SLOW_BELOW`` (0.8x the others) with its speed.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from flexorch.dashboards.plan_svg import task_colour
from flexorch.records.schema import RecordError, validate_record
from flexorch.records.writer import measured_bubble_share
from flexorch.solver.worker_speeds import SLOW_BELOW

__all__ = ["read_run", "step_view", "pipeline_view", "rank_speeds", "seq_tasks", "task_view"]

PARTIAL_LINE_GRACE_S = 10.0
"""A last line without its newline is taken as being written for this long, then reported as malformed."""


def read_run(run_dir: Path | str, since: int = 0) -> dict:
    """Records ``since`` onwards as views: ``{"total", "records", "error", "waiting"}``.

    ``error`` names the first malformed line (the records before it are returned); ``waiting`` is true while the
    run has written no records file yet."""
    path = Path(run_dir) / "steps.jsonl"
    if not path.exists():
        return {"total": 0, "records": [], "error": None, "waiting": True}
    views, error = [], None
    text = path.read_text()
    lines = text.splitlines()
    if not text.endswith("\n") and time.time() - path.stat().st_mtime < PARTIAL_LINE_GRACE_S:
        lines = lines[:-1]  # the writer is still writing that line: it shows on the next poll
    count = 0
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path.name} line {i}"
        try:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise RecordError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
            validate_record(rec, where)
        except RecordError as e:
            error = f"{e}. The records before it are shown; fix or remove that line (or re-run) to see the rest."
            break
        if count >= since:
            views.append(step_view(rec))
        count += 1
    return {"total": count, "records": views, "error": error, "waiting": False}


def _measured(rec: dict, mi: int, ranks: list[int]) -> tuple[float | None, float | None]:
    """Start and length of a group's micro-batch as measured: its members' latest start and longest time."""
    per_rank = rec.get("ranks") or []
    starts, times = [], []
    for r in ranks:
        entry = per_rank[r] if r < len(per_rank) else None
        if entry is None or entry["micro_batch_ms"][mi] is None:
            continue
        times.append(entry["micro_batch_ms"][mi])
        start = (entry.get("micro_batch_start_ms") or [None] * (mi + 1))[mi]
        if start is not None:
            starts.append(start)
    if not times:
        return None, None
    return (max(starts) if starts else None), max(times)


_OP_TIMES = ("start_ms", "end_ms")


def _measured_ops(rec: dict) -> dict[tuple[int, str, int], tuple[float, float]]:
    """Measured (start, length) of each (stage, kind, unit): the latest start and the longest time over the stage's
    ranks that reported the op (a lost rank's entry is null and counts for nothing)."""
    per_rank = rec.get("ranks") or []
    out: dict[tuple[int, str, int], tuple[float, float]] = {}
    for stage, ranks in enumerate(rec["pipeline"]["stage_ranks"]):
        for r in ranks:
            entry = per_rank[r] if r < len(per_rank) else None
            for op in (entry or {}).get("ops") or []:
                if not isinstance(op, dict) or any(not isinstance(op.get(k), (int, float)) for k in _OP_TIMES):
                    continue  # the schema checks how many ops a rank has, not each one: a broken entry draws nothing
                key = (stage, op.get("kind"), op.get("unit"))
                start, ms = op["start_ms"], op["end_ms"] - op["start_ms"]
                if key in out:
                    start, ms = max(start, out[key][0]), max(ms, out[key][1])
                out[key] = (start, ms)
    return out


def pipeline_view(rec: dict) -> dict:
    """The ``pipeline`` view of a pipelined record: its stages and one entry per op (stage, kind, unit) with the
    unit's chain, tokens, pieces and checkpointed layers, the predicted start and length (``pipeline.ops``) and the
    measured ones (train records; null for plan records and for ops no rank of the stage reported)."""
    pipe = rec["pipeline"]
    measured = _measured_ops(rec) if rec["source"] == "train" else {}
    ops = []
    for o in pipe["ops"]:
        u = pipe["units"][o["unit"]]
        pieces = u.get("pieces") or []
        ckpt = pipe["checkpointed"][o["stage"]]
        m_start, m_ms = measured.get((o["stage"], o["kind"], o["unit"]), (None, None))
        ops.append(
            {
                "stage": o["stage"],
                "kind": o["kind"],
                "unit": o["unit"],
                "chain": u.get("chain", 0),
                "pipeline": u.get("pipeline", 0),
                "tokens": u.get("tokens"),
                "pieces": len(pieces),
                "sequences": len({piece[0] for piece in pieces}),
                "checkpointed": ckpt[o["unit"]] if o["unit"] < len(ckpt) else None,
                "predicted_start_ms": o["start_ms"],
                "predicted_ms": o["end_ms"] - o["start_ms"],
                "measured_start_ms": m_start,
                "measured_ms": m_ms,
            }
        )
    return {
        "stages": pipe["stages"],
        "degree": pipe["degree"],
        "layers": pipe["layers"],
        "stage_ranks": pipe["stage_ranks"],
        "granularity": pipe["granularity"],
        "bubble_share": pipe["bubble_share"],
        "measured_bubble_share": measured_bubble_share(rec),
        "units": len(pipe["units"]),
        "pipelines": len({u.get("pipeline", 0) for u in pipe["units"]}),
        "ops": ops,
    }


def _number(v) -> float | None:
    """A finite number as is; null for anything else (a NaN loss would make the page's JSON unreadable)."""
    return v if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def _task_entries(rec: dict) -> list[tuple[str, dict]] | None:
    """The record's ``tasks`` as (name, entry) in task order, or None (no tasks, or not an object of objects)."""
    tasks = rec.get("tasks")
    if not isinstance(tasks, dict) or not tasks or not all(isinstance(e, dict) for e in tasks.values()):
        return None
    return list(tasks.items())


def seq_tasks(rec: dict) -> list[int] | None:
    """Each sequence's task index (``seq_lengths`` order: what a plan's ``seq_ids`` index), derived from the record's
    ``tasks``: the batch holds ``tasks[t].docs`` documents of each task, task 0's first. None for a record without
    tasks, or whose tasks' documents do not add up to its sequences (then no task can be told)."""
    entries = _task_entries(rec)
    if entries is None:
        return None
    counts = [e.get("docs") for _, e in entries]
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        return None
    if sum(counts) != len(rec["seq_lengths"]):
        return None
    return [t for t, c in enumerate(counts) for _ in range(c)]


def _group_task(seq_ids: list[int], of: list[int]) -> int | None:
    tasks = {of[i] for i in seq_ids}
    return tasks.pop() if len(tasks) == 1 else None


_MULTITASK_NUMBERS = ("bound_ms", "makespan_ms", "gap", "simulated_ms", "dataflow_ms", "solve_s")


def _multitask_view(rec: dict, names: list[str]) -> dict | None:
    """The record's ``multitask`` with its parts as objects (task index and name, first rank, devices, ranks, start
    and time in Spindle's cost model); null without one."""
    mt = rec.get("multitask")
    if not isinstance(mt, dict):
        return None
    parts = []
    for p in mt.get("parts") or []:
        if not isinstance(p, list | tuple) or len(p) < 5:
            continue
        task, first, devices, start, ms = p[:5]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (task, first, devices)):
            continue
        parts.append(
            {
                "task": task,
                "name": names[task] if 0 <= task < len(names) else f"task {task}",
                "first_rank": first,
                "devices": devices,
                "ranks": [first, first + devices - 1],
                "start_ms": _number(start),
                "time_ms": _number(ms),
            }
        )
    method = mt.get("multitask")
    out = {"method": method if isinstance(method, str) else None, "parts": parts}
    out.update({k: _number(mt.get(k)) for k in _MULTITASK_NUMBERS})
    return out


def task_view(rec: dict, groups: list[dict] | None = None) -> dict | None:
    """The tasks of a record of several ``[[tasks]]`` as the page shows them, or None for a record without tasks.

    ``tasks``: per task in order its ``index``, ``name``, ``colour`` (``plan_svg.task_colour``, as the SVG
    pictures), ``docs``, ``tokens``, ``targets``, ``loss`` (null where not a finite number), ``sequences`` (the
    batch's sequence ids of its documents), ``groups`` (how many of ``groups`` ran it) and ``ranks`` (the ranks
    they used); ``multitask`` (:func:`_multitask_view`); ``task_note``: why some groups have no task (the tasks'
    documents do not add up to the batch, or a group mixes tasks), else null."""
    entries = _task_entries(rec)
    if entries is None:
        return None
    names = [str(n) for n, _ in entries]
    of = seq_tasks(rec)
    losses = rec.get("task_losses") if isinstance(rec.get("task_losses"), dict) else {}
    tasks = []
    for t, (name, e) in enumerate(entries):
        mine = [g for g in groups or [] if g.get("task") == t]
        tasks.append(
            {
                "index": t,
                "name": names[t],
                "colour": task_colour(t),
                "docs": e.get("docs"),
                "tokens": e.get("tokens"),
                "targets": e.get("targets"),
                "loss": _number(e.get("loss") if e.get("loss") is not None else losses.get(name)),
                "sequences": [i for i, k in enumerate(of or []) if k == t],
                "groups": len(mine),
                "ranks": sorted({r for g in mine for r in g["ranks"]}),
            }
        )
    note = None
    if of is None:
        docs = [e.get("docs") for _, e in entries]
        note = (
            f"the tasks' documents ({', '.join(f'{n} {d}' for n, d in zip(names, docs, strict=True))}) do not add "
            f"up to the batch's {len(rec['seq_lengths'])} sequences: the groups are not coloured by task"
        )
    elif groups is not None and any(g.get("task") is None for g in groups):
        note = "some groups run the sequences of several tasks (a plan of one task per group should not)"
    return {"tasks": tasks, "multitask": _multitask_view(rec, names), "task_note": note}


def _rank_nodes(rec: dict) -> list[str] | None:
    """Each rank's node (the record's ``nodes``, or the plan's topology for a plan record), None where the ranks are
    on one node or it is not known: the page draws a boundary between consecutive ranks on different nodes."""
    nodes = rec.get("nodes")
    topology = (rec.get("plan") or {}).get("topology")
    if nodes is None and topology is not None:
        names = topology.get("node_names") or [f"node {i}" for i in range(len(topology["node_sizes"]))]
        nodes = [name for name, size in zip(names, topology["node_sizes"], strict=True) for _ in range(size)]
    return nodes if nodes and len(set(nodes)) > 1 else None


def _speed(v) -> float | None:
    """A speed as recorded: a finite number > 0, else None."""
    v = _number(v)
    return float(v) if v is not None and v > 0 else None


def rank_speeds(rec: dict) -> list[float] | None:
    """Each rank's relative speed (1.0 = the others), or None where the record says none (every rank at 1.0).

    Per rank: its entry's ``speed`` in ``ranks`` (a trained step: the speed the worker showed, estimated by the
    driver), else the speed its plan was priced with (``plan.topology.speeds``), else 1.0."""
    planned = ((rec.get("plan") or {}).get("topology") or {}).get("speeds") or []
    entries = rec.get("ranks") if isinstance(rec.get("ranks"), list) else []
    n = rec["world_size"]
    out, known = [], False
    for r in range(n):
        entry = entries[r] if r < len(entries) and isinstance(entries[r], dict) else {}
        speed = _speed(entry.get("speed"))
        if speed is None and r < len(planned):
            speed = _speed(planned[r])
        known = known or speed is not None
        out.append(1.0 if speed is None else speed)
    return out if known else None


def step_view(rec: dict) -> dict:
    """One validated record as the page draws it (the record's summary fields plus ``groups`` for SP steps, or
    ``pipeline`` (:func:`pipeline_view`; null for SP steps) for pipelined ones). ``tasks``, ``multitask`` and
    ``task_note`` are :func:`task_view`'s (all null for a record without tasks), and each group's ``task`` the index
    of the task it ran (null without tasks, or where that cannot be told); with 'auto' recompute each group's
    ``recompute`` is the mode it ran in ('none', 'selective', 'full'; null otherwise) and ``recompute_packing`` the
    planner's packings (the record's). ``nodes``: each rank's node where the ranks lie on several (else null).
    ``speeds``: :func:`rank_speeds`; ``slow_ranks``: the ranks below ``SLOW_BELOW`` (``slow_below``), shaded on the
    page; each group's ``speed`` its slowest member's (null without speeds)."""
    groups = []
    speeds = rank_speeds(rec)
    of = seq_tasks(rec)
    modes = rec.get("recompute")  # 'auto' recompute: each group's mode, per micro-batch
    if rec["plan"] is not None:
        when = {(t["micro_batch"], t["group"]): t for t in rec["timeline"]}
        trained = rec["source"] == "train"
        for mi, mb in enumerate(rec["plan"]["micro_batches"]):
            for gi, g in enumerate(mb):
                t = when[(mi, gi)]
                m_start, m_ms = _measured(rec, mi, g["ranks"]) if trained else (None, None)
                groups.append(
                    {
                        "micro_batch": mi,
                        "group": gi,
                        "degree": g["degree"],
                        "kind": g["kind"] if g["degree"] > 1 else "local",
                        "ranks": g["ranks"],
                        "first_rank": min(g["ranks"]),
                        "contiguous": max(g["ranks"]) - min(g["ranks"]) + 1 == len(g["ranks"]),
                        "sequences": len(g["seq_ids"]),
                        "tokens": sum(g["seq_lengths"]),
                        "longest": max(g["seq_lengths"], default=0),
                        "predicted_start_ms": t["start_ms"],
                        "predicted_ms": t["time_ms"],
                        "measured_start_ms": m_start,
                        "measured_ms": m_ms,
                        "task": None if of is None else _group_task(g["seq_ids"], of),
                        "recompute": modes[mi][gi] if modes else None,
                        "speed": None if speeds is None else min(speeds[r] for r in g["ranks"]),
                    }
                )
    keys = (
        "source step epoch world_size status skipped reason shape solve_s predicted_ms bound_ms baselines_ms tokens "
        "measured_ms compute_ms loss tokens_per_s worker_ids recoveries fallback solver_crashes recompute_packing"
    ).split()
    view = {k: rec.get(k) for k in keys}
    view["sequences"] = len(rec["seq_lengths"])
    view["longest"] = max(rec["seq_lengths"], default=0)
    view["micro_batches"] = len(rec["plan"]["micro_batches"]) if rec["plan"] else 0
    view["groups"] = groups
    view["nodes"] = _rank_nodes(rec)
    view["speeds"] = speeds
    view["slow_ranks"] = [] if speeds is None else [r for r, v in enumerate(speeds) if v < SLOW_BELOW]
    view["slow_below"] = SLOW_BELOW
    view["pipeline"] = pipeline_view(rec) if rec.get("pipeline") is not None else None
    view.update(task_view(rec, groups) or {"tasks": None, "multitask": None, "task_note": None})
    return view
