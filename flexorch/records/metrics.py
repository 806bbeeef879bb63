"""flexorch's per-step figures as Ray metrics (``ray.util.metrics``, docs/design.md §5).

Each node's Ray metrics agent exports them in Prometheus format (Ray adds the prefix ``ray_``, and ``_total`` to
counters), so the Ray dashboard's Grafana and any Prometheus that scrapes Ray see them. Every metric carries the
tag ``run`` (the run directory's name). Names, kinds and units:

======================================  =========  ==============================================================
``flexorch_step_measured_ms``           gauge      the last step, dispatch to the last worker outcome (ms)
``flexorch_step_predicted_ms``          gauge      the cost model's time for the last step's plan (ms)
``flexorch_step_time_ms``               histogram  every step's measured time (ms)
``flexorch_solve_ms``                   gauge      the planner's solve time for the last step (ms)
``flexorch_tokens_per_s``               gauge      trained (predicted) tokens per second of the last step
``flexorch_loss``                       gauge      the last step's loss
``flexorch_comm_share``                 gauge      predicted share of the step in SP all-to-all / ring transfers
                                                   and collective latency, on the critical path (0..1)
``flexorch_grad_sync_share``            gauge      measured share of the step in the gradient all-reduce (0..1)
``flexorch_idle_share``                 gauge      imbalance: 1 - mean / max of the ranks' compute times (0..1)
``flexorch_workers_alive``              gauge      workers in the world that ran the last step
``flexorch_plan_groups``                gauge      SP groups in the last step's plan, tags ``degree`` and ``kind``
``flexorch_pipeline_bubble_share``      gauge      simulated bubble share of the last pipelined step's schedule
                                                   (0..1; ``[pipeline] stages`` runs only)
``flexorch_pipeline_measured_bubble_share``  gauge  the same, measured: time the stage ranks spent outside their
                                                   ops (``flexorch.records.writer.measured_bubble_share``)
``flexorch_worker_speed``               gauge      each worker's speed relative to the others after the last step
                                                   (1.0: the median worker's), tags ``worker`` and ``node``
                                                   (``flexorch.control.speed_watch``)
``flexorch_steps_total``                counter    steps trained
``flexorch_skipped_batches_total``      counter    batches skipped as infeasible (``plan.on_infeasible="skip"``)
``flexorch_recoveries_total``           counter    membership changes, tag ``what``: ``shrink`` (after a
                                                   failure), ``grow`` (workers joined), ``rollback`` (stage-local
                                                   parameters lost with their holders: back to the checkpoint) or
                                                   ``drain`` (a draining node's workers left at a step boundary)
======================================  =========  ==============================================================
"""

from __future__ import annotations

import numpy as np
from ray.util.metrics import Counter, Gauge, Histogram

from flexorch.records.writer import measured_bubble_share
from flexorch.solver.plan import Plan
from flexorch.solver.profiles import Profile
from flexorch.solver.simulator import comm_share

__all__ = ["METRICS", "RunMetrics", "step_shares"]

# (name, kind, Grafana unit, panel title): the one list the dashboard (flexorch/dashboards/grafana.py) is built from
METRICS = (
    ("flexorch_step_measured_ms", "gauge", "ms", "Step time: measured"),
    ("flexorch_step_predicted_ms", "gauge", "ms", "Step time: predicted"),
    ("flexorch_step_time_ms", "histogram", "ms", "Step time p50 / p90"),
    ("flexorch_solve_ms", "gauge", "ms", "Planner solve time"),
    ("flexorch_tokens_per_s", "gauge", "short", "Tokens per second"),
    ("flexorch_loss", "gauge", "short", "Loss"),
    ("flexorch_comm_share", "gauge", "percentunit", "SP communication share (predicted)"),
    ("flexorch_grad_sync_share", "gauge", "percentunit", "Gradient all-reduce share"),
    ("flexorch_idle_share", "gauge", "percentunit", "Idle (imbalance) share"),
    ("flexorch_workers_alive", "gauge", "short", "Workers alive"),
    ("flexorch_plan_groups", "gauge", "short", "SP groups per degree"),
    ("flexorch_pipeline_bubble_share", "gauge", "percentunit", "Pipeline bubble share (simulated)"),
    ("flexorch_pipeline_measured_bubble_share", "gauge", "percentunit", "Pipeline bubble share (measured)"),
    ("flexorch_worker_speed", "gauge", "short", "Worker speed (1.0 = the others)"),
    ("flexorch_steps_total", "counter", "short", "Steps trained"),
    ("flexorch_skipped_batches_total", "counter", "short", "Batches skipped"),
    ("flexorch_plan_fallbacks_total", "counter", "short", "Plan fallbacks by reason"),
    ("flexorch_solver_crashes_total", "counter", "short", "MILP solver crashes"),
    ("flexorch_recoveries_total", "counter", "short", "Membership changes"),
    ("flexorch_recovery_ms", "gauge", "ms", "Last recovery: detect / re-form / re-run / total"),
)

STEP_MS_BOUNDARIES = [10, 30, 100, 300, 1_000, 3_000, 10_000, 30_000, 100_000]


def step_shares(record: dict) -> tuple[float, float]:
    """(gradient-sync share, idle share) of a trained step's record."""
    measured = max(record["measured_ms"], 1e-9)
    ends = np.array([r["compute_end_ms"] for r in record["ranks"] if r is not None], dtype=float)
    idle = 1.0 - float(ends.mean() / ends.max()) if ends.size and ends.max() > 0 else 0.0
    return min(record["sync_ms"] / measured, 1.0), idle


class RunMetrics:
    """The metrics of one run; the driver calls :meth:`on_step` and :meth:`on_recovery`."""

    def __init__(self, run: str):
        self._tags = {"run": run}
        run_tag = ("run",)

        def gauge(name, desc, extra=()):
            return Gauge(name, description=desc, tag_keys=run_tag + extra)

        self.measured = gauge("flexorch_step_measured_ms", "Measured step time, dispatch to last outcome (ms)")
        self.predicted = gauge("flexorch_step_predicted_ms", "Cost-model time of the step's plan (ms)")
        self.step_hist = Histogram(
            "flexorch_step_time_ms",
            description="Measured step times (ms)",
            boundaries=STEP_MS_BOUNDARIES,
            tag_keys=run_tag,
        )
        self.solve = gauge("flexorch_solve_ms", "Planner solve time of the step (ms)")
        self.tokens_per_s = gauge("flexorch_tokens_per_s", "Trained tokens per second")
        self.loss = gauge("flexorch_loss", "Training loss of the step")
        self.comm = gauge("flexorch_comm_share", "Predicted SP communication share of the step (0..1)")
        self.sync = gauge("flexorch_grad_sync_share", "Measured gradient all-reduce share of the step (0..1)")
        self.idle = gauge("flexorch_idle_share", "Imbalance: 1 - mean/max rank compute time (0..1)")
        self.alive = gauge("flexorch_workers_alive", "Workers in the world that ran the step")
        self.groups = gauge("flexorch_plan_groups", "SP groups in the step's plan", ("degree", "kind"))
        self.bubble = gauge("flexorch_pipeline_bubble_share", "Simulated bubble share of the step's pipeline")
        self.measured_bubble = gauge(
            "flexorch_pipeline_measured_bubble_share", "Measured bubble share of the step's pipeline"
        )
        self.speed = gauge(
            "flexorch_worker_speed", "Worker speed relative to the others (1.0: median)", ("worker", "node")
        )
        self.steps = Counter("flexorch_steps_total", description="Steps trained", tag_keys=run_tag)
        self.skipped = Counter("flexorch_skipped_batches_total", description="Batches skipped", tag_keys=run_tag)
        self.recoveries = Counter(
            "flexorch_recoveries_total", description="Membership changes", tag_keys=run_tag + ("what",)
        )
        self.recovery_time = gauge(
            "flexorch_recovery_ms",
            "Time the last recovery cost, by phase (detect, handoff, reform, rerun, total)",
            ("phase",),
        )
        self.fallbacks = Counter(
            "flexorch_plan_fallbacks_total",
            description="Steps that did not get the planner's own plan, by reason (timeout, crash, error, infeasible)",
            tag_keys=run_tag + ("reason",),
        )
        self.solver_crashes = Counter(
            "flexorch_solver_crashes_total", description="MILP solves that died natively", tag_keys=run_tag
        )
        self._group_keys: set[tuple[str, str]] = set()

    def on_step(self, record: dict, plan, profile: Profile) -> None:
        """``plan``: the step's :class:`~solver.plan.Plan`, a pipelined step's ``StagedPlan``, or None."""
        t = self._tags
        if record.get("fallback"):
            self.fallbacks.inc(1, tags={**t, "reason": record["fallback"]["reason"]})
        if record.get("solver_crashes"):
            self.solver_crashes.inc(record["solver_crashes"], tags=t)
        if record["skipped"]:
            self.skipped.inc(1, tags=t)
            return
        self.steps.inc(1, tags=t)
        self.measured.set(record["measured_ms"], tags=t)
        self.step_hist.observe(record["measured_ms"], tags=t)
        self.predicted.set(record["predicted_ms"], tags=t)
        self.solve.set(record["solve_s"] * 1e3, tags=t)
        self.tokens_per_s.set(record["tokens_per_s"], tags=t)
        self.loss.set(record["loss"], tags=t)
        self.alive.set(record["world_size"], tags=t)
        sync, idle = step_shares(record)
        self.sync.set(sync, tags=t)
        self.idle.set(idle, tags=t)
        if record["pipeline"] is not None:
            self.bubble.set(record["pipeline"]["bubble_share"], tags=t)
            measured_bubble = measured_bubble_share(record)
            if measured_bubble is not None:
                self.measured_bubble.set(measured_bubble, tags=t)
        if isinstance(plan, Plan):
            self.comm.set(comm_share(plan, profile), tags=t)
            counts: dict[tuple[str, str], int] = {}
            for mb in plan.micro_batches:
                for g in mb.groups:
                    key = (str(g.degree), g.kind)
                    counts[key] = counts.get(key, 0) + 1
            for key in self._group_keys | set(counts):  # a degree absent this step reads 0, not its old count
                self.groups.set(counts.get(key, 0), tags={**t, "degree": key[0], "kind": key[1]})
            self._group_keys |= set(counts)

    def on_speeds(self, worker_ids, nodes, speeds) -> None:
        """Each worker's speed after a step (``control.speed_watch.SpeedWatch``; ``nodes``: each one's node or None)."""
        for w, node, speed in zip(worker_ids, nodes, speeds, strict=True):
            self.speed.set(speed, tags={**self._tags, "worker": str(w), "node": str(node or "")})

    def on_recovery(self, record: dict) -> None:
        what = "rollback" if record.get("rollback") else "grow" if record.get("what") == "grow" else "shrink"
        if record.get("what") in ("drain", "retire"):  # a planned leave: a draining node's or a slow worker's
            what = record["what"]
            if not record.get("fallback"):
                for phase, key in (("handoff", "handoff_ms"), ("reform", "reform_ms"), ("total", "recovery_ms")):
                    self.recovery_time.set(record[key], tags={**self._tags, "phase": phase})
        if record.get("driver_restart"):
            what = "driver"
        self.recoveries.inc(1, tags={**self._tags, "what": what})
        if "total_ms" in record:  # a failure recovered within the step: detect, re-form, re-run as lived
            phases = {"detect": record.get("detect_ms", 0.0), "reform": record["recovery_ms"]}
            phases |= {"rerun": record["rerun_ms"], "total": record["total_ms"]}
            for phase, ms in phases.items():
                self.recovery_time.set(ms, tags={**self._tags, "phase": phase})
