"""A picture of a multi-task step plan (Spindle, arXiv 2409.03365): devices (ranks) down, time across.

Pure Python (no plotting dependency): ``multitask_svg`` returns SVG text that any browser shows. Each part of the
plan (some layers of one task's MetaOp on an aligned block of ranks) is one rectangle spanning its block's rows,
coloured by task (``plan_svg.task_colour``: the dashboards' one palette, so a task has the same colour here, in
``plan_svg``'s task mode and in the plan viewer) and labelled ``task Lk xlayers`` where it is wide enough; hovering
shows its numbers. Dashed lines mark the wave starts; a red line marks the makespan; idle device time is white.
Under Spindle's schedule, on the same time scale, come the two baselines (``multitask.baselines``): the tasks in
turn on all devices and the fixed split, so the picture shows where Spindle's schedule saves time.

Every part rectangle carries ``class="part"`` and ``data-*`` attributes (panel, task, level, layers, first rank,
count, start and time in ms) so tests and tools can read the picture back.
"""

from __future__ import annotations

import math
from html import escape

from flexorch.dashboards.plan_svg import task_colour
from flexorch.solver.multitask.baselines import fixed_split_parts, in_turn_parts
from flexorch.solver.multitask.plan import MultiTaskPlan, Part, waves_of

__all__ = ["multitask_svg", "task_colour"]

_LEFT, _WIDTH, _PANEL_H = 70.0, 900.0, 320.0


def _text_colour(fill: str) -> str:
    """Black on light fills, white on dark ones."""
    if not fill.startswith("#"):
        return "white"
    r, g, b = (int(fill[i : i + 2], 16) for i in (1, 3, 5))
    return "#222" if 0.299 * r + 0.587 * g + 0.114 * b > 170 else "white"


def _names(plan: MultiTaskPlan, task_names) -> dict[int, str]:
    tasks = sorted({m.task for m in plan.metaops})
    if task_names is not None:
        names = list(task_names)
        if len(names) < len(tasks):
            raise ValueError(f"task_names has {len(names)} names for {len(tasks)} tasks")
        return {t: str(names[t]) for t in tasks}
    out = {t: f"task {t}" for t in tasks}
    for m in sorted(plan.metaops, key=lambda m: -m.level):  # level 0 last: its name wins
        if m.name:
            out[m.task] = m.name.split("/")[0]
    return out


def _fmt_ms(ms: float) -> str:
    return f"{ms:,.0f} ms" if math.isfinite(ms) else "n/a"


def _nice_step(span: float, ticks: int = 6) -> float:
    raw = span / ticks
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)


def _panel(key, title, parts, n, names, y0, scale, end_ms, note="") -> tuple[list[str], float]:
    """One schedule's panel (title, time grid, parts, wave starts, makespan, rank labels) and the y below it."""
    row = min(12.0, _PANEL_H / n)
    top = y0 + 22.0
    height = n * row
    out = [f'<text x="{_LEFT}" y="{y0 + 15:.1f}" font-size="13" font-weight="bold">{escape(title)}</text>']
    out.append(f'<rect x="{_LEFT}" y="{top:.1f}" width="{_WIDTH}" height="{height:.1f}" fill="white" stroke="#333"/>')
    if not parts:
        out[-1] = f'<rect x="{_LEFT}" y="{top:.1f}" width="{_WIDTH}" height="30" fill="white" stroke="#333"/>'
        out.append(
            f'<text x="{_LEFT + _WIDTH / 2}" y="{top + 19:.1f}" font-size="12" text-anchor="middle" '
            f'fill="#666">{escape(note or "no schedule")}</text>'
        )
        return out, top + 42
    step = _nice_step(end_ms)
    t = step
    while t < end_ms:
        x = _LEFT + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{top:.1f}" x2="{x:.2f}" y2="{top + height:.1f}" stroke="#eee"/>')
        t += step
    for p in sorted(parts, key=lambda p: (p.start_ms, p.devices[0])):
        out.extend(_part(key, p, names, top, row, scale))
    out.extend(_waves_and_makespan(parts, top, height, scale))
    out.append(f'<text x="{_LEFT - 6}" y="{top + 10:.1f}" font-size="10" text-anchor="end">rank 0</text>')
    out.append(f'<text x="{_LEFT - 6}" y="{top + height:.1f}" font-size="10" text-anchor="end">{n - 1}</text>')
    return out, top + height + 12


def _part(key: str, p: Part, names: dict[int, str], top: float, row: float, scale: float) -> list[str]:
    """One part's rectangle (with its ``data-*`` numbers and hover text) and, where it fits, its label."""
    fill = task_colour(p.task)
    x = _LEFT + p.start_ms * scale
    w = p.time_ms * scale
    y = top + p.devices[0] * row
    h = len(p.devices) * row
    tip = (
        f"{names[p.task]} level {p.metaop}: {p.layers} layers on ranks {p.devices[0]}-{p.devices[-1]} "
        f"({len(p.devices)} devices), {p.start_ms:,.1f}-{p.end_ms:,.1f} ms ({p.time_ms:,.1f} ms)"
    )
    out = [
        f'<rect class="part" data-panel="{key}" data-task="{p.task}" data-level="{p.metaop}" '
        f'data-layers="{p.layers}" data-first="{p.devices[0]}" data-count="{len(p.devices)}" '
        f'data-start-ms="{p.start_ms!r}" data-time-ms="{p.time_ms!r}" '
        f'x="{x:.3f}" y="{y:.3f}" width="{w:.3f}" height="{h:.3f}" fill="{fill}" stroke="white" '
        f'stroke-width="0.5"><title>{escape(tip)}</title></rect>'
    ]
    if h >= 11 and w >= 30:
        label = f"{names[p.task]} L{p.metaop} x{p.layers}"
        fit = int((w - 4) / 6)  # about 6 px a character at font-size 10
        if fit < len(label):
            label = label[: max(0, fit - 1)] + "…" if fit >= 4 else ""
        if label:
            out.append(
                f'<text x="{x + 3:.2f}" y="{y + min(h, 24) / 2 + 4:.2f}" font-size="10" '
                f'fill="{_text_colour(fill)}" pointer-events="none">{escape(label)}</text>'
            )
    return out


def _waves_and_makespan(parts, top: float, height: float, scale: float) -> list[str]:
    """The dashed wave starts and the red makespan line with its time."""
    out = []
    for wave in waves_of(parts)[1:]:
        x = _LEFT + wave.start_ms * scale
        out.append(
            f'<line class="wave" x1="{x:.2f}" y1="{top:.1f}" x2="{x:.2f}" y2="{top + height:.1f}" stroke="#000" '
            f'stroke-width="0.8" stroke-dasharray="4 3"/>'
        )
    span = max(p.end_ms for p in parts)
    x = _LEFT + span * scale
    out.append(
        f'<line x1="{x:.2f}" y1="{top - 4:.1f}" x2="{x:.2f}" y2="{top + height + 4:.1f}" stroke="#d62728" '
        f'stroke-width="1.5"/>'
    )
    anchor = "end" if x > _LEFT + _WIDTH - 60 else "start"
    out.append(
        f'<text x="{x + (-3 if anchor == "end" else 3):.2f}" y="{top - 5:.1f}" font-size="10" fill="#d62728" '
        f'text-anchor="{anchor}">{escape(_fmt_ms(span))}</text>'
    )
    return out


def _speedup(base: float, ms: float) -> str:
    return f"{base / ms:.2f}x" if math.isfinite(base) else "n/a"


def multitask_svg(plan: MultiTaskPlan, task_names=None, title: str | None = None, baselines: bool = True) -> str:
    """The plan's picture: Spindle's schedule, then (``baselines``) the in-turn and fixed-split schedules."""
    names = _names(plan, task_names)
    n = plan.num_devices
    panels = _schedules(plan, baselines)
    end_ms = max(max(p.end_ms for p in ps) for _, _, ps, _ in panels if ps)
    scale = _WIDTH / end_ms if end_ms > 0 else 1.0
    head, summary = _head_and_summary(plan, names, title)
    out = [
        f'<text x="{_LEFT}" y="22" font-size="15" font-weight="bold">{escape(head)}</text>',
        f'<text class="summary" x="{_LEFT}" y="40" font-size="12">{escape(summary)}</text>',
    ]
    y = 48.0
    if plan.note:
        out.append(f'<text x="{_LEFT}" y="{y + 10:.1f}" font-size="11" fill="#666">{escape(plan.note)}</text>')
        y += 14
    for key, ptitle, ps, note in panels:
        panel, y = _panel(key, ptitle, ps, n, names, y, scale, end_ms, note)
        out.extend(panel)
    total_h = _time_axis_and_legend(out, names, y, scale, end_ms)
    svg_head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_LEFT + _WIDTH + 30:.0f}" height="{total_h:.0f}" '
        f'font-family="sans-serif"><title>{escape(head)}: {escape(summary)}</title>'
        f'<rect width="100%" height="100%" fill="#fafafa"/>'
    )
    return svg_head + "".join(out) + "</svg>\n"


def _schedules(plan: MultiTaskPlan, baselines: bool) -> list[tuple[str, str, tuple[Part, ...] | None, str]]:
    """The panels to draw: (key, title, parts, note when there are none), Spindle's schedule first."""
    n = plan.num_devices
    panels: list[tuple[str, str, tuple[Part, ...] | None, str]] = [
        ("plan", f"{plan.method} schedule ({len(plan.waves)} waves, {len(plan.parts)} parts)", plan.parts, "")
    ]
    if baselines:
        turn = in_turn_parts(plan.metaops, n)
        split = fixed_split_parts(plan.metaops, n)
        panels.append(("in_turn", "baseline: tasks in turn, each on all devices", turn, ""))
        panels.append(
            (
                "fixed_split",
                "baseline: fixed split, each task on its own block",
                split,
                "impossible: the tasks' fewest devices add up to more than the cluster",
            )
        )
    return panels


def _head_and_summary(plan: MultiTaskPlan, names: dict[int, str], title: str | None) -> tuple[str, str]:
    """The picture's title and its summary line: makespan, bound, gap and the baselines' times and speedups."""
    ms = plan.makespan_ms
    turn_ms = plan.baselines_ms.get("in_turn", math.inf)
    split_ms = plan.baselines_ms.get("fixed_split", math.inf)
    head = title or f"multi-task step: {plan.num_devices} devices, {len(names)} tasks"
    summary = (
        f"{plan.method}: makespan {_fmt_ms(ms)}, bound {_fmt_ms(plan.bound_ms)}, gap {plan.gap * 100:.1f} %; "
        f"in turn {_fmt_ms(turn_ms)} ({_speedup(turn_ms, ms)}), fixed split {_fmt_ms(split_ms)} "
        f"({_speedup(split_ms, ms)})"
    )
    return head, summary


def _time_axis_and_legend(out: list[str], names: dict[int, str], y: float, scale: float, end_ms: float) -> float:
    """Append the time axis under the panels at ``y``, the task legend and the key to the marks; returns the height."""
    step = _nice_step(end_ms)
    t, y_ticks = 0.0, y + 4
    while t <= end_ms * (1 + 1e-9):
        x = _LEFT + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{y - 12:.1f}" x2="{x:.2f}" y2="{y - 8:.1f}" stroke="#333"/>')
        out.append(f'<text x="{x:.1f}" y="{y_ticks:.1f}" font-size="10" text-anchor="middle">{t / 1000:g} s</text>')
        t += step
    legend_y, x = y_ticks + 22, _LEFT
    for t in sorted(names):
        label = names[t]
        out.append(
            f'<rect class="legend" x="{x:.1f}" y="{legend_y - 9:.1f}" width="10" height="10" fill="{task_colour(t)}"/>'
        )
        out.append(f'<text x="{x + 14:.1f}" y="{legend_y:.1f}" font-size="10">{escape(label)}</text>')
        x += 24 + 6 * len(label)
        if x > _LEFT + _WIDTH - 80:
            x, legend_y = _LEFT, legend_y + 16
    out.append(
        f'<text x="{_LEFT}" y="{legend_y + 18:.1f}" font-size="10" fill="#666">dashed: wave starts; red: makespan; '
        f"label: task, MetaOp level, layers; white: idle</text>"
    )
    return legend_y + 28
