"""What runs beside every step, after its record is written: one callback each, called by the driver in order.

The driver's step transition (``control.driver``) ends by writing the record (``records.writer.StepRecords``) and
handing it to each :class:`StepCallback` of :func:`step_callbacks`, in this order:

1. :class:`TrackerCallback`: the run's trackers (TensorBoard, MLflow, W&B; ``records.trackers``);
2. :class:`MetricsCallback`: the Prometheus metrics (``records.metrics``), the step's and each recovery's;
3. ``control.fallback_watch.FallbackWatch``: the warning when many recent steps ran without the planner's plan;
4. :class:`CheckpointCallback`: a checkpoint every ``checkpoint_every`` steps;
5. :class:`ProgressCallback`: the step event the console and the dashboards read, with the run's ETA.

A callback sees the record as the file has it (schema version and time added). After a roll-back to a checkpoint
the driver calls ``on_rewind(step)`` on every callback (a no-op unless it keeps something per step): the records
after ``step`` are written again. Each callback is given what it needs (the trackers, a function that saves a
checkpoint), never the driver.
Ray Train v2 is the model: the controller's decisions stay values, everything beside the step is a callback.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = [
    "CheckpointCallback",
    "MetricsCallback",
    "ProgressCallback",
    "StepCallback",
    "TrackerCallback",
    "step_callbacks",
]


class StepCallback:
    """What runs beside every step: :meth:`on_step` after each record, :meth:`on_rewind` after a roll-back."""

    def on_step(self, record: dict, plan) -> None:
        """``record``: the step's record as written; ``plan``: the plan it ran (None for a skipped batch)."""
        raise NotImplementedError

    def on_rewind(self, step: int) -> None:
        """The run went back to the checkpoint of ``step``: the records after it are written again."""


class TrackerCallback(StepCallback):
    """Every record to the run's trackers; a roll-back rewinds them."""

    def __init__(self, trackers):
        self.trackers = trackers

    def on_step(self, record: dict, plan) -> None:
        self.trackers.log_step(record)

    def on_rewind(self, step: int) -> None:
        self.trackers.rewind(step)


class MetricsCallback(StepCallback):
    """The step's metrics (priced with the profile the run plans with now) and each recovery's."""

    def __init__(self, metrics, profile_of):
        self.metrics, self._profile_of = metrics, profile_of

    def on_step(self, record: dict, plan) -> None:
        self.metrics.on_step(record, plan, self._profile_of())
        for rec in record["recoveries"]:
            self.metrics.on_recovery(rec)


class CheckpointCallback(StepCallback):
    """A checkpoint every ``every`` steps (``checkpoint_every``; the run's end after ``steps`` writes its own)."""

    def __init__(self, every: int | None, steps: int, save: Callable[[], object]):
        self.every, self.steps, self._save = every, steps, save

    def on_step(self, record: dict, plan) -> None:
        done = record["step"] + 1  # steps done once this one is: the driver's step number now
        if self.every and done % self.every == 0 and done < self.steps:
            self._save()


class ProgressCallback(StepCallback):
    """The step event (the record, and the time left at the pace of the last 10 steps' wall time); ``started``
    says when the step just recorded began (``time.perf_counter``)."""

    def __init__(self, steps: int, publish: Callable[[dict], None], started: Callable[[], float]):
        self.steps, self._publish, self._started = steps, publish, started
        self._wall: list[float] = []

    def on_step(self, record: dict, plan) -> None:
        self._wall.append(time.perf_counter() - self._started())
        recent = self._wall[-10:]
        eta_s = (self.steps - (record["step"] + 1)) * sum(recent) / len(recent)
        self._publish({"event": "step", **record, "eta_s": eta_s})


def step_callbacks(
    cfg, trackers, metrics, fallbacks: StepCallback, *, profile_of, save, publish, started
) -> list[StepCallback]:
    """The run's callbacks in the order they are called (the module's docstring says why each is there):
    ``profile_of`` gives the profile the run plans with now, ``save`` writes a checkpoint, ``publish`` an event,
    ``started`` the time the step just recorded began."""
    return [
        TrackerCallback(trackers),
        MetricsCallback(metrics, profile_of),
        fallbacks,
        CheckpointCallback(cfg.checkpoint_every, cfg.steps, save),
        ProgressCallback(cfg.steps, publish, started),
    ]
