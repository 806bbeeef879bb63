"""A picture of a step's plan: devices (ranks) down, time across, one box per SP group.

Pure Python (no plotting dependency): `render_svg` returns SVG text that any browser shows. Boxes are coloured
by SP degree; a box's label gives degree, attention kind and how many sequences it runs; dashed lines mark the
micro-batch boundaries; idle device time is white.

A step of several ``[[tasks]]`` can be coloured by task instead (``task_of``: each sequence's task index, as the
planner's ``task_of``): every SP group runs one task's sequences, so each box takes its task's colour
(:func:`task_colour`, the palette the multi-task picture and the plan viewer use too) and the legend names the
tasks. :data:`PALETTE` is the one Tableau palette of the dashboards' SVG pictures.

A plan priced with worker speeds (``plan.topology.speeds``: a group runs at its slowest member's pace,
``solver.simulator``) shades each device slower than :data:`~flexorch.solver.worker_speeds.SLOW_BELOW` (0.8x the
others): its row is tinted behind the boxes (``class="slow"``), a mark at the panel's left edge and its speed at the
right (``0.52x``, ``class="slow-label"``) name it, with a tooltip; a box on such a device says the pace it runs at.
Runs of consecutive ranks at one speed (a slow node) are shaded and labelled once.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from flexorch.solver.plan import Plan
from flexorch.solver.profiles import Profile
from flexorch.solver.simulator import group_timings, micro_batch_times_ms
from flexorch.solver.worker_speeds import SLOW_BELOW

__all__ = ["MIXED_COLOUR", "PALETTE", "SLOW_FILL", "SLOW_TEXT", "render_steps_svg", "render_svg", "task_colour"]

PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
    "#86bcb6",
)
"""Tableau's palette: SP degree 2^i takes colour i here (and in the plan viewer's page), task t colour t."""

MIXED_COLOUR = "#777"
"""A box whose colour the palette cannot give: a degree past it, a group whose sequences belong to several tasks."""


SLOW_FILL = "#f7c6c0"
"""The tint of a slow device's row (behind the boxes: it shows where the device idles)."""
SLOW_TEXT = "#b2182b"
"""A slow device's mark at the panel's left edge and its speed label at the right."""


def task_colour(task: int) -> str:
    """A fixed colour per task index: :data:`PALETTE`, then golden-angle hues (distinct for any count)."""
    if 0 <= task < len(PALETTE):
        return PALETTE[task]
    return f"hsl({(task * 137.508) % 360:.0f},55%,45%)"


def _colour(degree: int) -> str:
    i = degree.bit_length() - 1 if degree > 0 else 0
    return PALETTE[i] if degree.bit_length() <= len(PALETTE) else MIXED_COLOUR


def _group_task(seq_ids, task_of) -> int | None:
    """The task of a group's sequences, None where they belong to several."""
    tasks = {int(task_of[i]) for i in seq_ids}
    return tasks.pop() if len(tasks) == 1 else None


def _panel(
    plan: Plan, profile: Profile, title: str, y0: float, width: float, ms_scale: float, task_of=None, names=None
) -> tuple[list, float]:
    n = plan.num_devices
    row = max(2.0, min(12.0, 480.0 / n))
    left, top = 70.0, y0 + 28.0
    parts = [f'<text x="{left}" y="{y0 + 18:.1f}" font-size="13" font-weight="bold">{escape(title)}</text>']
    height = n * row
    parts.append(f'<rect x="{left}" y="{top}" width="{width}" height="{height:.1f}" fill="white" stroke="#333"/>')
    slow = _slow_runs(plan)
    parts += _slow_bands(slow, left, top, width, row)
    for g in group_timings(plan, profile):
        grp = plan.micro_batches[g.micro_batch].groups[g.group]
        x = left + g.start_ms * ms_scale
        w = max(0.5, g.time_ms * ms_scale)
        y = top + g.first_rank * row
        h = g.degree * row
        u = grp.ulysses_degree
        kind = g.kind if u is None else f"{g.kind} {u}x{g.degree // u}"
        spans = plan.topology is not None and plan.topology.spans(grp.ranks)
        tip = (
            f"micro-batch {g.micro_batch}, ranks {grp.ranks[0]}-{grp.ranks[-1]}, degree {g.degree} {kind}, "
            f"{len(grp.seq_ids)} seqs, {g.time_ms:.0f} ms" + (", across nodes" if spans else "")
        )
        pace = 1.0 if plan.topology is None else plan.topology.speed_of(grp.ranks)
        if pace != 1.0:
            tip += f", at {pace:.2f}x (its slowest member's speed)"
        fill, attrs = _colour(g.degree), ""
        if names is not None:  # task mode: a step without tasks (task_of None) is no task's, grey
            task = None if task_of is None else _group_task(grp.seq_ids, task_of)
            fill = MIXED_COLOUR if task is None else task_colour(task)
            tip = f"{'several tasks' if task is None else names(task)}: {tip}"
            attrs = f' class="group" data-task="{"" if task is None else task}"'
        parts.append(
            f'<rect{attrs} x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{h:.2f}" fill="{fill}" '
            f'stroke="white" stroke-width="0.5"><title>{escape(tip)}</title></rect>'
        )
        if h >= 11 and w >= 60:
            parts.append(
                f'<text x="{x + 3:.2f}" y="{y + min(h, 24) / 2 + 4:.2f}" font-size="10" fill="white">'
                f"d={g.degree} {g.kind[0]} x{len(grp.seq_ids)}</text>"
            )
    t = 0.0
    for span in micro_batch_times_ms(plan, profile)[:-1]:
        t += span
        x = left + t * ms_scale
        parts.append(
            f'<line x1="{x:.2f}" y1="{top}" x2="{x:.2f}" y2="{top + height:.1f}" stroke="#000" stroke-dasharray="4 3"/>'
        )
    parts += _node_lines(plan, left, top, width, row)
    parts += _slow_labels(slow, left, top, width, row)
    parts.append(f'<text x="{left - 6}" y="{top + 10}" font-size="10" text-anchor="end">rank 0</text>')
    parts.append(f'<text x="{left - 6}" y="{top + height:.1f}" font-size="10" text-anchor="end">{n - 1}</text>')
    return parts, top + height + 22


def _slow_runs(plan: Plan) -> list[tuple[int, int, float]]:
    """(first rank, ranks, speed) of each run of consecutive ranks at one speed below ``SLOW_BELOW``, from the
    speeds the plan was priced with (its topology's); none without speeds."""
    topo = plan.topology
    if topo is None or topo.uniform_speed:
        return []
    runs: list[tuple[int, int, float]] = []
    for r, speed in enumerate(topo.rank_speeds()):
        if speed >= SLOW_BELOW:
            continue
        if runs and runs[-1][0] + runs[-1][1] == r and runs[-1][2] == speed:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, speed)
        else:
            runs.append((r, 1, speed))
    return runs


def _slow_tip(first: int, count: int, speed: float) -> str:
    who = f"rank {first}" if count == 1 else f"ranks {first}-{first + count - 1}"
    return escape(f"{who}: {speed:.2f}x the others (slow: below {SLOW_BELOW:g}x); a group waits for its slowest member")


def _slow_bands(runs, left: float, top: float, width: float, row: float) -> list[str]:
    """Each slow run's row tinted across the panel (drawn before the boxes: it shows where the device idles)."""
    return [
        f'<rect class="slow" data-rank="{a}" data-ranks="{k}" data-speed="{v:.3g}" x="{left}" y="{top + a * row:.2f}" '
        f'width="{width}" height="{k * row:.2f}" fill="{SLOW_FILL}" stroke="none"><title>{_slow_tip(a, k, v)}</title>'
        "</rect>"
        for a, k, v in runs
    ]


def _slow_labels(runs, left: float, top: float, width: float, row: float) -> list[str]:
    """Each slow run's mark at the panel's left edge and its speed at the right (drawn over the boxes)."""
    out = []
    for a, k, v in runs:
        y, h, tip = top + a * row, k * row, _slow_tip(a, k, v)
        out.append(
            f'<rect class="slow-mark" x="{left - 4}" y="{y:.2f}" width="4" height="{h:.2f}" fill="{SLOW_TEXT}">'
            f"<title>{tip}</title></rect>"
        )
        out.append(
            f'<text class="slow-label" data-rank="{a}" x="{left + width + 3:.1f}" y="{y + h / 2 + 3:.2f}" '
            f'font-size="9" fill="{SLOW_TEXT}"><title>{tip}</title>{v:.2f}x</text>'
        )
    return out


def _node_lines(plan: Plan, left: float, top: float, width: float, row: float) -> list[str]:
    """A plan with a topology: a line across the panel at each node boundary, each node's name and size at its
    left (``class="node"``)."""
    topo = plan.topology
    if topo is None or topo.num_nodes < 2:
        return []
    out = []
    for i, (a, size, name) in enumerate(zip(topo.node_starts, topo.node_sizes, topo.names(), strict=True)):
        y = top + a * row
        if i:
            out.append(
                f'<line class="node" x1="{left - 28}" y1="{y:.2f}" x2="{left + width:.1f}" y2="{y:.2f}" '
                f'stroke="#c00" stroke-width="1.2"/>'
            )
        if size * row >= 10:
            out.append(
                f'<text class="node" x="{left - 30}" y="{y + size * row / 2 + 3:.2f}" font-size="9" fill="#c00" '
                f'text-anchor="end"><title>{escape(name)}: {size} live workers</title>{escape(name)} ({size})</text>'
            )
    return out


def _check_task_of(steps, task_of) -> list:
    if len(task_of) != len(steps):
        raise ValueError(f"task_of needs one entry per step ({len(steps)}), got {len(task_of)}")
    for (title, plan), tasks in zip(steps, task_of, strict=True):
        if tasks is not None and len(tasks) != len(plan.seq_lengths):
            raise ValueError(
                f"task_of of step {title!r} has {len(tasks)} tasks for the plan's {len(plan.seq_lengths)} sequences"
            )
    return list(task_of)


def _task_legend(parts: list, steps, by_task, name, legend_y: float, width: float) -> float:
    """One swatch per task drawn (and a grey one where a box is no single task's); returns the last row's y."""
    used = sorted({int(t) for tasks in by_task if tasks is not None for t in tasks})
    entries = [(task_colour(t), name(t), f' class="legend" data-task="{t}"') for t in used]
    mixed = any(
        tasks is None or _group_task(g.seq_ids, tasks) is None
        for (_, p), tasks in zip(steps, by_task, strict=True)
        for mb in p.micro_batches
        for g in mb.groups
    )
    if mixed:  # a step drawn without tasks beside task steps, or a group of several tasks
        entries.append((MIXED_COLOUR, "several tasks / no task", ' class="legend"'))
    x = 70.0
    for fill, label, attrs in entries:
        if x > 70.0 and x + 24 + 6 * len(label) > width + 70:
            x, legend_y = 70.0, legend_y + 16
        parts.append(f'<rect{attrs} x="{x:.1f}" y="{legend_y - 9:.1f}" width="10" height="10" fill="{fill}"/>')
        parts.append(f'<text x="{x + 14:.1f}" y="{legend_y:.1f}" font-size="10">{escape(label)}</text>')
        x += max(70.0, 24 + 6 * len(label))
    return legend_y


def render_steps_svg(
    steps: list[tuple[str, Plan]],
    profile: Profile,
    width: float = 900.0,
    task_of: Sequence | None = None,
    task_names: Sequence[str] | None = None,
) -> str:
    """One panel per (title, plan), sharing one time scale so steps compare by width.

    ``task_of`` (optional, one entry per step: each sequence's task index, or None for a step of no task) colours
    each group by its task and puts the tasks in the legend (``task_names``, default ``task 0``, ...); a group of
    several tasks, or of a step without them, is grey."""
    longest = max(sum(micro_batch_times_ms(p, profile)) for _, p in steps)
    scale = width / longest if longest > 0 else 1.0
    by_task = _check_task_of(steps, task_of) if task_of is not None else [None] * len(steps)
    names = list(task_names or [])

    def name(t: int) -> str:
        return str(names[t]) if t < len(names) else f"task {t}"

    parts, y = [], 10.0
    for (title, plan), tasks in zip(steps, by_task, strict=True):
        panel, y = _panel(plan, profile, title, y, width, scale, tasks, name if task_of is not None else None)
        parts.extend(panel)
    ticks = 5
    for i in range(ticks + 1):
        ms = longest * i / ticks
        x = 70 + ms * scale
        parts.append(f'<text x="{x:.1f}" y="{y:.1f}" font-size="10" text-anchor="middle">{ms / 1000:.2f} s</text>')
    legend_y = y + 18
    if any(t is not None for t in by_task):
        legend_y = _task_legend(parts, steps, by_task, name, legend_y, width)
    else:
        for i, d in enumerate(sorted({g.degree for _, p in steps for mb in p.micro_batches for g in mb.groups})):
            x = 70 + i * 70
            parts.append(f'<rect x="{x}" y="{legend_y - 9}" width="10" height="10" fill="{_colour(d)}"/>')
            parts.append(f'<text x="{x + 14}" y="{legend_y}" font-size="10">SP {d}</text>')
    if any(_slow_runs(p) for _, p in steps):
        legend_y += 16
        parts.append(f'<rect class="legend-slow" x="70" y="{legend_y - 9}" width="10" height="10" fill="{SLOW_FILL}"/>')
        parts.append(
            f'<text x="84" y="{legend_y}" font-size="10">slow device (below {SLOW_BELOW:g}x the others; its speed '
            "at the right)</text>"
        )
    total_h = legend_y + 12
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 100:.0f}" height="{total_h:.0f}" '
        f'font-family="sans-serif"><rect width="100%" height="100%" fill="#fafafa"/>'
    )
    return head + "".join(parts) + "</svg>\n"


def render_svg(plan: Plan, profile: Profile, title: str = "plan", task_of=None, task_names=None) -> str:
    """A single plan's picture (``task_of``: each sequence's task, to colour the groups by task)."""
    return render_steps_svg(
        [(title, plan)], profile, task_of=None if task_of is None else [task_of], task_names=task_names
    )
