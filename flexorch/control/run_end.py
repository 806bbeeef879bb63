"""How a run ends, and the state the CLI's threads write into a running driver.

A run ends done (every step trained), stopped (a signal asked for a stop: the loop ends after the step in flight and
writes a checkpoint), shut down under the running loop (a second Ctrl-C, the CLI failing: what then fails in the
loop is not the run's error), or on an error (published, then raised). :class:`RunEnd` holds the stop reason and
whether a shutdown came, both written from the CLI's threads and read by the run loop between steps (single
assignments, read once per step), and the error the run ended on.
"""

from __future__ import annotations

from collections.abc import Callable

from flexorch.control.transitions import EventLog

__all__ = ["RunEnd"]


class RunEnd:
    """The end of a run that publishes to ``events``."""

    def __init__(self, events: EventLog, publish: Callable[[dict], None]):
        self.events, self._publish = events, publish
        self.reason: str | None = None
        """Why the loop stops after the step in flight (a stop asked for, or a shutdown); None: it goes on."""
        self.closing = False
        """A shutdown came while the loop was still going: its failures are not the run's."""
        self.error: str | None = None
        """The error the run ended on (published as the ``error`` event)."""

    def request_stop(self, reason: str, step_no: int) -> None:
        """Stop after the step in flight (``step_no``): the first reason given is kept."""
        if self.reason is None:
            self.reason = reason
            self._publish(
                {
                    "event": "progress",
                    "message": f"{reason}: stopping after step {step_no + 1} (the one in "
                    "flight), then writing a checkpoint",
                }
            )

    def shutdown_came(self) -> None:
        """The workers and the planner are being shut down: a loop still going stops, and is not failed by it."""
        if not self.events.done:
            self.closing = True
            self.reason = self.reason or "shutdown"

    def done(self, steps: int, skipped_batches: int, checkpoint: str, records: str) -> dict:
        """The loop ended after ``steps`` steps with the run's last ``checkpoint``: the ``done`` event, published."""
        summary = {
            "event": "done",
            "steps": steps,
            "skipped_batches": skipped_batches,
            "checkpoint": checkpoint,
            "records": records,
            "stopped": self.reason,
        }
        self._publish(summary)
        return summary

    def stopped(self, steps: int) -> dict:
        """The loop failed after a shutdown took its workers: the ``stopped`` event, published; its summary."""
        self._publish({"event": "stopped", "step": steps})
        return {"event": "stopped", "steps": steps, "stopped": self.reason or "shutdown"}

    def failed(self, err: Exception) -> None:
        """The run ends on ``err``: the ``error`` event, published."""
        self.error = f"{type(err).__name__}: {err}"
        self._publish({"event": "error", "error": self.error})

    def close(self, trackers) -> None:
        """The loop has ended: a failed run is marked failed in its trackers, and pollers see the end."""
        if trackers is not None:  # after the error event
            trackers.close(failed=self.error is not None)
        self.events.done = True
