"""The Grafana dashboard JSON: built from the metric list, checked in unchanged, one panel per metric (fast)."""

from __future__ import annotations

import json
import re

from flexorch.dashboards.grafana import DASHBOARD_PATH, build_dashboard
from flexorch.records.metrics import METRICS


def test_checked_in_dashboard_is_the_generated_one():
    assert json.loads(DASHBOARD_PATH.read_text()) == build_dashboard(), "run: python -m flexorch.dashboards.grafana"


def test_one_panel_per_metric_and_every_query_names_a_known_series():
    dash = build_dashboard()
    names = {m[0] for m in METRICS}
    described = [p["description"].split(" ")[0] for p in dash["panels"]]
    assert sorted(described) == sorted(names)
    for panel in dash["panels"]:
        assert panel["targets"] and panel["datasource"] == "${datasource}"
        for t in panel["targets"]:
            series = re.findall(r"ray_(flexorch_\w+?)(?:_bucket)?\{", t["expr"])
            assert series and set(series) <= names, t["expr"]
            assert 'run=~"$run"' in t["expr"] and 'SessionName=~"$SessionName"' in t["expr"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert "ray_flexorch_steps_total" in variables["run"]["definition"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(set(ids)) == len(ids)
