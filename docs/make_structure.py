"""Draw flexorch's sub-packages and the imports between them: ``docs/structure.svg`` and the line-count table.

Stdlib only. Reads the real import graph (every import statement, including those inside functions) of every module
under ``flexorch/``; one box per sub-package with its line count, layers top to bottom, an arrow per imported
sub-package. Run ``python docs/make_structure.py`` from the repository root after moving code between folders."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
ROOT = REPO / "flexorch"
LAYERS = [["cli", "testing"], ["dashboards", "control"], ["records", "workers", "data"], ["config", "work"], ["solver"]]
BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN = 170, 54, 60, 70, 30


def sub_package(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def edges() -> set[tuple[str, str]]:
    out = set()
    for path in ROOT.rglob("*.py"):
        src = sub_package(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                if parts[0] == "flexorch" and len(parts) > 1 and parts[1] != src:
                    out.add((src, parts[1]))
    return out


def line_counts() -> dict[str, tuple[int, int]]:
    counts: dict[str, tuple[int, int]] = {}
    for path in ROOT.rglob("*.py"):
        files, lines = counts.get(sub_package(path), (0, 0))
        counts[sub_package(path)] = (files + 1, lines + len(path.read_text().splitlines()))
    return counts


def svg(counts: dict[str, tuple[int, int]], graph: set[tuple[str, str]]) -> str:
    width = max(len(row) for row in LAYERS) * (BOX_W + GAP_X) - GAP_X + 2 * MARGIN
    height = len(LAYERS) * (BOX_H + GAP_Y) - GAP_Y + 2 * MARGIN
    pos = {}
    for y, row in enumerate(LAYERS):
        row_w = len(row) * (BOX_W + GAP_X) - GAP_X
        for x, name in enumerate(row):
            pos[name] = ((width - row_w) / 2 + x * (BOX_W + GAP_X), MARGIN + y * (BOX_H + GAP_Y))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">',
        '<defs><marker id="a" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    for src, dst in sorted(graph):
        if src not in pos or dst not in pos:
            continue
        (x1, y1), (x2, y2) = pos[src], pos[dst]
        up = y2 < y1
        sx, sy = x1 + BOX_W / 2, y1 + (0 if up else BOX_H)
        tx, ty = x2 + BOX_W / 2, y2 + (BOX_H if up else 0)
        if y1 == y2:
            sy, ty = y1 + BOX_H / 2, y2 + BOX_H / 2
            sx, tx = (x1 + BOX_W, x2) if x2 > x1 else (x1, x2 + BOX_W)
        colour = "#c00" if up or y1 == y2 else "#555"
        parts.append(
            f'<line x1="{sx:.0f}" y1="{sy:.0f}" x2="{tx:.0f}" y2="{ty:.0f}" stroke="{colour}" stroke-width="1.3" '
            'marker-end="url(#a)" opacity="0.8"/>'
        )
    for name, (x, y) in pos.items():
        files, lines = counts.get(name, (0, 0))
        parts += [
            f'<rect x="{x:.0f}" y="{y:.0f}" width="{BOX_W}" height="{BOX_H}" rx="6" fill="#eef3fb" stroke="#36c"/>',
            f'<text x="{x + BOX_W / 2:.0f}" y="{y + 22:.0f}" text-anchor="middle" font-size="15" '
            f'font-weight="bold">{name}</text>',
            f'<text x="{x + BOX_W / 2:.0f}" y="{y + 42:.0f}" text-anchor="middle" font-size="12" '
            f'fill="#444">{files} files, {lines:,} lines</text>',
        ]
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def table(counts: dict[str, tuple[int, int]]) -> str:
    rows = ["| sub-package | files | lines |", "|---|---:|---:|"]
    rows += [f"| `flexorch/{n}` | {f} | {lines:,} |" for n, (f, lines) in sorted(counts.items())]
    return "\n".join(rows)


def main() -> None:
    counts = {k: v for k, v in line_counts().items()}
    graph = edges()
    drawn = {n for row in LAYERS for n in row}
    missing = sorted(set(counts) - drawn - {"__init__", "__main__"})
    if missing:
        raise SystemExit(f"sub-packages without a layer in LAYERS: {missing}")
    (REPO / "docs" / "structure.svg").write_text(svg(counts, graph))
    print(table(counts))


if __name__ == "__main__":
    main()
