"""The flexorch Grafana dashboard, built from `flexorch.records.metrics.METRICS` (one panel per metric).

It targets the Prometheus data source that Ray's metrics integration provisions (a ``datasource`` variable of
type prometheus, as Ray's own dashboards use) and filters by the ``run`` tag and Ray's ``SessionName``.
``dashboards/flexorch_grafana_dashboard.json`` is this module's output, checked in so a user can import it
without Python; ``python -m flexorch.dashboards.grafana`` rewrites it, and a test keeps the two equal.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flexorch.records.metrics import METRICS

__all__ = ["DASHBOARD_PATH", "build_dashboard", "panel_query"]

DASHBOARD_PATH = Path(__file__).with_name("flexorch_grafana_dashboard.json")
_FILTER = 'run=~"$run", SessionName=~"$SessionName"'


def panel_query(name: str, kind: str) -> list[tuple[str, str]]:
    """(PromQL, legend) pairs of a metric's panel; Ray exports ``name`` as ``ray_<name>``."""
    metric = f"ray_{name}"
    if kind == "histogram":
        return [
            (
                f"histogram_quantile({q}, sum by (le, run) (rate({metric}_bucket{{{_FILTER}}}[$__rate_interval])))",
                f"p{int(q * 100)} {{{{run}}}}",
            )
            for q in (0.5, 0.9)
        ]
    if kind == "counter":
        return [(f"sum by (run) ({metric}{{{_FILTER}}})", "{{run}}")]
    if name == "flexorch_plan_fallbacks_total":
        return [(f"sum by (run, reason) ({metric}{{{_FILTER}}})", "{{reason}} {{run}}")]
    if name == "flexorch_worker_speed":  # one series per worker: a slow one stands out (1.0 = the others)
        return [(f"min by (run, worker, node) ({metric}{{{_FILTER}}})", "worker {{worker}} {{node}} {{run}}")]
    if name == "flexorch_plan_groups":
        return [(f"sum by (run, degree, kind) ({metric}{{{_FILTER}}})", "SP={{degree}} {{kind}} {{run}}")]
    return [(f"max by (run) ({metric}{{{_FILTER}}})", "{{run}}")]


def _panel(i: int, name: str, kind: str, unit: str, title: str) -> dict:
    targets = [
        {"datasource": "${datasource}", "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + j)}
        for j, (expr, legend) in enumerate(panel_query(name, kind))
    ]
    return {
        "id": i + 1,
        "type": "timeseries",
        "title": title,
        "description": f"{name} ({kind})",
        "datasource": "${datasource}",
        "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": 8 * (i // 3)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": targets,
    }


def _query_variable(name: str, query: str) -> dict:
    return {
        "name": name,
        "type": "query",
        "datasource": "${datasource}",
        "definition": query,
        "query": {"query": query, "refId": "StandardVariableQuery"},
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }


def build_dashboard() -> dict:
    return {
        "title": "flexorch: per-step plans",
        "uid": "flexorch-steps",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "5s",
        "time": {"from": "now-30m", "to": "now"},
        "tags": ["flexorch", "ray"],
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "hide": 0, "current": {}},
                _query_variable("SessionName", "label_values(ray_flexorch_steps_total, SessionName)"),
                _query_variable("run", 'label_values(ray_flexorch_steps_total{SessionName=~"$SessionName"}, run)'),
            ]
        },
        "panels": [_panel(i, *m) for i, m in enumerate(METRICS)],
    }


def main() -> int:
    DASHBOARD_PATH.write_text(json.dumps(build_dashboard(), indent=1) + "\n")
    print(f"wrote {DASHBOARD_PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
