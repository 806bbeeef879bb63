"""flexorch's Ray metrics: a real Ray with its metrics agent on loopback, a few real steps, then the node's
Prometheus export endpoint is scraped and every flexorch metric is found with a sane value."""

from __future__ import annotations

import re
import socket
import time
import urllib.request

import pytest

from flexorch.control.driver import TrainingDriver
from flexorch.records.metrics import step_shares
from flexorch.records.writer import measured_bubble_share
from tests.train_helpers import cpu_profile, train_config, write_corpus

pytestmark = pytest.mark.slow

NAMES = [
    "flexorch_step_measured_ms",
    "flexorch_step_predicted_ms",
    "flexorch_step_time_ms_count",
    "flexorch_solve_ms",
    "flexorch_tokens_per_s",
    "flexorch_loss",
    "flexorch_comm_share",
    "flexorch_grad_sync_share",
    "flexorch_idle_share",
    "flexorch_workers_alive",
    "flexorch_plan_groups",
    "flexorch_steps_total",
    "flexorch_worker_speed",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int, run: str) -> dict[str, list[tuple[dict, float]]]:
    """{metric name without Ray's prefix: [(labels, value), ...]} of this run's samples."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict = {}
    for line in text.splitlines():
        m = re.match(r"ray_(flexorch_\w+)\{(.*)\} (\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            if labels.get("run") == run:
                out.setdefault(m.group(1), []).append((labels, float(m.group(3))))
    return out


def test_flexorch_metrics_reach_the_prometheus_export(tmp_path):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    port = _free_port()
    ray.init(
        address="local",
        num_cpus=5,
        include_dashboard=False,
        logging_level="ERROR",
        _metrics_export_port=port,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    try:
        corpus_dir = write_corpus(tmp_path / "corpus")
        cfg = train_config(corpus_dir, tmp_path / "metrics-run", cpu_profile(tmp_path / "profile.json"), steps=3)
        driver = TrainingDriver(cfg)
        try:
            driver.setup()
            records = [driver.step().record for _ in range(cfg.steps)]
        finally:
            driver.shutdown()
        # a pipelined run beside it (2 steps): its schedule's bubble share is exported too. 2 workers, one a stage
        # (a whole document fits one: 256 tokens), where 4 took twice as long to start (~11 s here) for the same metric
        from flexorch.config import ModelConfig

        pp_cfg = train_config(
            corpus_dir, tmp_path / "metrics-pp", cfg.plan.profile, steps=2, model=ModelConfig(num_layers=4),
            pipeline={"stages": 2}, workers=2, plan={"tokens_per_worker": 256},
        )  # fmt: skip
        pp_driver = TrainingDriver(pp_cfg)
        try:
            pp_driver.setup()
            pp_records = [pp_driver.step().record for _ in range(pp_cfg.steps)]
        finally:
            pp_driver.shutdown()
        # the export is flushed every second, metric by metric: wait until it shows each run's last step (a
        # scrape between two flushes can hold step 1's gauge beside step 2's counter)
        pp_bubble = pp_records[-1]["pipeline"]["bubble_share"]
        deadline = time.monotonic() + 60
        while True:
            found = _scrape(port, "metrics-run")
            pp_found = _scrape(port, "metrics-pp")
            if (
                all(n in found for n in NAMES)
                and found["flexorch_steps_total"][0][1] == 3
                and found["flexorch_step_measured_ms"][0][1] == pytest.approx(records[-1]["measured_ms"], rel=1e-6)
                and pp_found.get("flexorch_steps_total", [({}, 0)])[0][1] == 2
                and pp_found.get("flexorch_pipeline_bubble_share", [({}, -1.0)])[0][1]
                == pytest.approx(pp_bubble, rel=1e-6)
                and pp_found.get("flexorch_pipeline_measured_bubble_share", [({}, -1.0)])[0][1]
                == pytest.approx(measured_bubble_share(pp_records[-1]), rel=1e-6)
            ):
                break
            assert time.monotonic() < deadline, (
                f"missing: {[n for n in NAMES if n not in found]}; found {found}; pipelined run: {pp_found}, "
                f"its last bubble share {pp_bubble}"
            )
            time.sleep(1)
    finally:
        ray.shutdown()

    bubble = pp_found["flexorch_pipeline_bubble_share"][0][1]
    assert bubble == pytest.approx(pp_records[-1]["pipeline"]["bubble_share"], rel=1e-6) and 0.0 <= bubble < 1.0
    assert "flexorch_pipeline_bubble_share" not in found  # an SP run has no pipeline
    measured_bubble = pp_found["flexorch_pipeline_measured_bubble_share"][0][1]
    assert measured_bubble == pytest.approx(measured_bubble_share(pp_records[-1]), rel=1e-6)
    assert 0.0 <= measured_bubble < 1.0 and "flexorch_pipeline_measured_bubble_share" not in found
    last = records[-1]
    value = {n: v[0][1] for n, v in found.items()}
    assert value["flexorch_step_measured_ms"] == pytest.approx(last["measured_ms"], rel=1e-6)
    assert value["flexorch_step_predicted_ms"] == pytest.approx(last["predicted_ms"], rel=1e-6)
    assert value["flexorch_loss"] == pytest.approx(last["loss"], rel=1e-6)
    assert value["flexorch_workers_alive"] == 4 and value["flexorch_step_time_ms_count"] == 3
    assert value["flexorch_tokens_per_s"] == pytest.approx(last["tokens_per_s"], rel=1e-6)
    sync, idle = step_shares(last)
    assert value["flexorch_grad_sync_share"] == pytest.approx(sync, rel=1e-6)
    assert value["flexorch_idle_share"] == pytest.approx(idle, rel=1e-6, abs=1e-9)
    for share in ("flexorch_comm_share", "flexorch_grad_sync_share", "flexorch_idle_share"):
        assert 0.0 <= value[share] <= 1.0, share
    # the Grafana dashboard queries series that the export really has (the series no failure here hit aside; the
    # pipeline bubble comes from the pipelined run)
    from flexorch.dashboards.grafana import build_dashboard

    for panel in build_dashboard()["panels"]:
        for t in panel["targets"]:
            for name in re.findall(r"ray_(flexorch_\w+)\{", t["expr"]):
                not_here = (
                    "flexorch_skipped_batches_total",
                    "flexorch_recoveries_total",
                    "flexorch_recovery_ms",
                    "flexorch_plan_fallbacks_total",
                    "flexorch_solver_crashes_total",
                )
                assert name in found or name in not_here or name in pp_found, name
    # each worker's speed: the gauge is the last record's, and each rank names its node and process (issue 63)
    speeds = {lab["worker"]: v for lab, v in found["flexorch_worker_speed"]}
    assert sorted(speeds) == sorted(str(w) for w in last["worker_ids"])
    for w, entry in zip(last["worker_ids"], last["ranks"], strict=True):
        assert isinstance(entry["pid"], int) and entry["pid"] > 0 and entry["node"], entry
        assert speeds[str(w)] == pytest.approx(entry["speed"], abs=1e-6) and entry["speed"] > 0
    assert len({e["pid"] for e in last["ranks"]}) == 4  # one process per worker
    # what each rank waited of each of its groups' time (CPU workers): none where it sat out, none in a group alone
    for rec in records:
        for r, entry in enumerate(rec["ranks"]):
            assert len(entry["wait_ms"]) == len(entry["micro_batch_ms"]), entry
            for mi, (w, t) in enumerate(zip(entry["wait_ms"], entry["micro_batch_ms"], strict=True)):
                assert (w is None) == (t is None) and (w is None or 0.0 <= w <= t), (rec["step"], r, entry)
                (group,) = [g for g in rec["plan"]["micro_batches"][mi] if r in g["ranks"]] if t is not None else [None]
                assert group is None or group["degree"] > 1 or w == 0.0, (rec["step"], r, group, w)
    groups = {(lab["degree"], lab["kind"]): v for lab, v in found["flexorch_plan_groups"]}
    expected: dict = {}
    for mb in last["plan"]["micro_batches"]:
        for g in mb:
            key = (str(g["degree"]), g["kind"])
            expected[key] = expected.get(key, 0) + 1
    assert {k: v for k, v in groups.items() if v} == expected
