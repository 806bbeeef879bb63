"""A picture of pipeline schedules: stages down, time across, one box per forward or backward op.

Pure Python (SVG text, like ``flexorch.dashboards.plan_svg``). A forward is a light box, a backward a dark one, both in
the colour of the op's sequence chain (a split sequence's segments share a colour, so Seq1F1B's reversed backward order
shows); a hatched band marks a backward that recomputes checkpointed layers; white is a bubble. Several schedules (e.g.
the elastic plan and the baselines for the same batch) share one time scale so their widths compare.
"""

from __future__ import annotations

from html import escape

from flexorch.solver.pipeline.plan import PipelinePlan

__all__ = ["render_pipelines_svg"]

_HUES = [210, 30, 0, 175, 120, 50, 290, 340, 20, 260, 90, 190]


def _fill(chain: int, backward: bool) -> str:
    hue = _HUES[chain % len(_HUES)]
    return f"hsl({hue}, 55%, {38 if backward else 72}%)"


def _panel(plan: PipelinePlan, title: str, y0: float, width: float, scale: float) -> tuple[list[str], float]:
    p = plan.stages
    row, left, top = 22.0, 70.0, y0 + 26.0
    parts = [f'<text x="{left}" y="{y0 + 16:.1f}" font-size="13" font-weight="bold">{escape(title)}</text>']
    parts.append(f'<rect x="{left}" y="{top}" width="{width}" height="{p * row:.1f}" fill="white" stroke="#333"/>')
    offset = 0.0
    for pipe in plan.pipelines:
        for t in pipe.run.timings:
            u = pipe.units[t.op.unit]
            x = left + (offset + t.start_ms) * scale
            w = max(0.6, (t.end_ms - t.start_ms) * scale)
            y = top + t.stage * row + 1
            back = t.op.kind == "B"
            ckpt = pipe.checkpointed[t.stage][t.op.unit] if back else 0
            tip = (
                f"stage {t.stage} {t.op.kind} unit {t.op.unit} ({u.tokens} tokens, {len(u.pieces)} piece(s), "
                f"segment {u.position}), {t.end_ms - t.start_ms:.0f} ms"
                + (f", recomputes {ckpt} layer(s)" if ckpt else "")
            )
            parts.append(
                f'<rect x="{x:.2f}" y="{y:.1f}" width="{w:.2f}" height="{row - 2:.1f}" fill="{_fill(u.chain, back)}" '
                f'stroke="white" stroke-width="0.4"><title>{escape(tip)}</title></rect>'
            )
            if ckpt:
                band = (row - 2) / 4  # a hatched band on top of the box
                parts.append(
                    f'<rect x="{x:.2f}" y="{y:.1f}" width="{w:.2f}" height="{band:.1f}" fill="url(#recompute)"/>'
                )
        offset += pipe.run.makespan_ms
        if offset < plan.makespan_ms:  # the boundary between back-to-back pipelines
            x = left + offset * scale
            parts.append(f'<line x1="{x:.2f}" y1="{top}" x2="{x:.2f}" y2="{top + p * row}" stroke="#000"/>')
    for r in range(p):
        parts.append(
            f'<text x="{left - 6}" y="{top + r * row + row / 2 + 4:.1f}" font-size="10" text-anchor="end">'
            f"stage {r}</text>"
        )
    info = (
        f"{plan.makespan_ms / 1e3:.1f} s, bubble {plan.bubble_share:.1%}, {len(plan.units)} units, "
        f"{len(plan.pipelines)} pipeline(s)"
    )
    parts.append(f'<text x="{left + width}" y="{y0 + 16:.1f}" font-size="11" text-anchor="end">{escape(info)}</text>')
    return parts, top + p * row + 14


def render_pipelines_svg(plans: list[tuple[str, PipelinePlan]], width: float = 1000.0) -> str:
    """One panel per (title, plan) on a shared time axis."""
    if not plans:
        raise ValueError("nothing to draw: no pipeline plans given")
    longest = max(p.makespan_ms for _, p in plans)
    scale = width / longest if longest > 0 else 1.0
    parts, y = [], 8.0
    for title, plan in plans:
        panel, y = _panel(plan, title, y, width, scale)
        parts.extend(panel)
    for i in range(6):
        ms = longest * i / 5
        parts.append(
            f'<text x="{70 + ms * scale:.1f}" y="{y + 4:.1f}" font-size="10" text-anchor="middle">'
            f"{ms / 1e3:.1f} s</text>"
        )
    legend = y + 22
    parts.append(f'<rect x="70" y="{legend - 9}" width="12" height="10" fill="{_fill(0, False)}"/>')
    parts.append(f'<text x="86" y="{legend}" font-size="10">forward</text>')
    parts.append(f'<rect x="150" y="{legend - 9}" width="12" height="10" fill="{_fill(0, True)}"/>')
    parts.append(f'<text x="166" y="{legend}" font-size="10">backward (colour: sequence chain)</text>')
    parts.append(f'<rect x="370" y="{legend - 9}" width="12" height="10" fill="url(#recompute)" stroke="#999"/>')
    parts.append(f'<text x="386" y="{legend}" font-size="10">recomputes checkpointed layers</text>')
    defs = (
        '<defs><pattern id="recompute" width="4" height="4" patternUnits="userSpaceOnUse">'
        '<path d="M0,4 L4,0" stroke="#111" stroke-width="1"/></pattern></defs>'
    )
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 100:.0f}" height="{legend + 12:.0f}" '
        f'font-family="sans-serif">{defs}<rect width="100%" height="100%" fill="#fafafa"/>'
    )
    return head + "".join(parts) + "</svg>\n"
