"""What runs beside every step, after its record is written: one callback each, called by the driver in order.

The driver's step transition (``control.driver``) ends by writing the record (``records.writer.StepRecords``) and
handing it to each :class:`StepCallback` of :func:`step_callbacks`, in this order:

1. :class:`TrackerCallback`: the run's trackers (TensorBoard, MLflow, W&B; ``records.trackers``);
2. :class:`MetricsCallback`: the Prometheus metrics (``records.metrics``), the step's and each recovery's;
3. ``control.fallback_watch.FallbackWatch``: the warning when many recent steps ran without the planner's plan;
4. :class:`CheckpointCallback`: a checkpoint every ``checkpoint_every`` steps;
5. :class:`ProgressCallback`: the step event the console and the dashboards read, with the run's ETA.

A callback sees the record as the file has it (schema version and time added). After a roll-back to a checkpoint
the driver calls ``on_rewind(step)`` on the callbacks that have one: the records after ``step`` are written again.
Ray Train v2 is the model: the controller's decisions stay values, everything beside the step is a callback.
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = [
    "CheckpointCallback",
    "MetricsCallback",
    "ProgressCallback",
    "StepCallback",
    "TrackerCallback",
    "step_callbacks",
]


class StepCallback(Protocol):
    def on_step(self, record: dict, plan) -> None:
        """``record``: the step's record as written; ``plan``: the plan it ran (None for a skipped batch)."""


class TrackerCallback:
    """Every record to the run's trackers; a roll-back rewinds them."""

    def __init__(self, trackers):
        self.trackers = trackers

    def on_step(self, record: dict, plan) -> None:
        self.trackers.log_step(record)

    def on_rewind(self, step: int) -> None:
        self.trackers.rewind(step)


class MetricsCallback:
    """The step's metrics (priced with the profile the run plans with now) and each recovery's."""

    def __init__(self, metrics, profile_of):
        self.metrics, self._profile_of = metrics, profile_of

    def on_step(self, record: dict, plan) -> None:
        self.metrics.on_step(record, plan, self._profile_of())
        for rec in record["recoveries"]:
            self.metrics.on_recovery(rec)


class CheckpointCallback:
    """A checkpoint every ``checkpoint_every`` steps (the run's end writes its own)."""

    def __init__(self, driver):
        self.driver = driver

    def on_step(self, record: dict, plan) -> None:
        d = self.driver
        every = d.cfg.checkpoint_every
        if every and d.step_no % every == 0 and not d.finished:
            d.checkpoint()


class ProgressCallback:
    """The step event (the record, and the time left at the pace of the last 10 steps' wall time)."""

    def __init__(self, driver):
        self.driver = driver
        self._wall: list[float] = []

    def on_step(self, record: dict, plan) -> None:
        d = self.driver
        self._wall.append(time.perf_counter() - d.step_started)
        recent = self._wall[-10:]
        eta_s = (d.cfg.steps - d.step_no) * sum(recent) / len(recent)
        d._publish({"event": "step", **record, "eta_s": eta_s})


def step_callbacks(driver) -> list[StepCallback]:
    """The run's callbacks in the order they are called (the module's docstring says why each is there)."""
    return [
        TrackerCallback(driver.trackers),
        MetricsCallback(driver.metrics, lambda: driver.profile),
        driver._fallbacks,
        CheckpointCallback(driver),
        ProgressCallback(driver),
    ]
