"""A picture of a step's plan: devices (ranks) down, time across, one box per SP group.

Pure Python (no plotting dependency): `render_svg` returns SVG text that any browser shows. Boxes are coloured
by SP degree; a box's label gives degree, attention kind and how many sequences it runs; dashed lines mark the
micro-batch boundaries; idle device time is white.
"""

from __future__ import annotations

from html import escape

from flexorch.solver.plan import Plan
from flexorch.solver.profiles import Profile
from flexorch.solver.simulator import group_timings, micro_batch_times_ms

__all__ = ["render_svg", "render_steps_svg"]

_COLOURS = [
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
]


def _colour(degree: int) -> str:
    return _COLOURS[degree.bit_length() - 1 if degree > 0 else 0] if degree.bit_length() <= len(_COLOURS) else "#777"


def _panel(plan: Plan, profile: Profile, title: str, y0: float, width: float, ms_scale: float) -> tuple[list, float]:
    n = plan.num_devices
    row = max(2.0, min(12.0, 480.0 / n))
    left, top = 70.0, y0 + 28.0
    parts = [f'<text x="{left}" y="{y0 + 18:.1f}" font-size="13" font-weight="bold">{escape(title)}</text>']
    height = n * row
    parts.append(f'<rect x="{left}" y="{top}" width="{width}" height="{height:.1f}" fill="white" stroke="#333"/>')
    for g in group_timings(plan, profile):
        grp = plan.micro_batches[g.micro_batch].groups[g.group]
        x = left + g.start_ms * ms_scale
        w = max(0.5, g.time_ms * ms_scale)
        y = top + g.first_rank * row
        h = g.degree * row
        tip = (
            f"micro-batch {g.micro_batch}, ranks {grp.ranks[0]}-{grp.ranks[-1]}, degree {g.degree} {g.kind}, "
            f"{len(grp.seq_ids)} seqs, {g.time_ms:.0f} ms"
        )
        parts.append(
            f'<rect x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{h:.2f}" fill="{_colour(g.degree)}" '
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
    parts.append(f'<text x="{left - 6}" y="{top + 10}" font-size="10" text-anchor="end">rank 0</text>')
    parts.append(f'<text x="{left - 6}" y="{top + height:.1f}" font-size="10" text-anchor="end">{n - 1}</text>')
    return parts, top + height + 22


def render_steps_svg(steps: list[tuple[str, Plan]], profile: Profile, width: float = 900.0) -> str:
    """One panel per (title, plan), sharing one time scale so steps compare by width."""
    longest = max(sum(micro_batch_times_ms(p, profile)) for _, p in steps)
    scale = width / longest if longest > 0 else 1.0
    parts, y = [], 10.0
    for title, plan in steps:
        panel, y = _panel(plan, profile, title, y, width, scale)
        parts.extend(panel)
    ticks = 5
    for i in range(ticks + 1):
        ms = longest * i / ticks
        x = 70 + ms * scale
        parts.append(f'<text x="{x:.1f}" y="{y:.1f}" font-size="10" text-anchor="middle">{ms / 1000:.2f} s</text>')
    legend_y = y + 18
    for i, d in enumerate(sorted({g.degree for _, p in steps for mb in p.micro_batches for g in mb.groups})):
        x = 70 + i * 70
        parts.append(f'<rect x="{x}" y="{legend_y - 9}" width="10" height="10" fill="{_colour(d)}"/>')
        parts.append(f'<text x="{x + 14}" y="{legend_y}" font-size="10">SP {d}</text>')
    total_h = legend_y + 12
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 100:.0f}" height="{total_h:.0f}" '
        f'font-family="sans-serif"><rect width="100%" height="100%" fill="#fafafa"/>'
    )
    return head + "".join(parts) + "</svg>\n"


def render_svg(plan: Plan, profile: Profile, title: str = "plan") -> str:
    """A single plan's picture."""
    return render_steps_svg([(title, plan)], profile)
