"""The recovery of a driver started in place of a lost one (``flexorch.cli.train``), recorded once it has lived.

The CLI sees the driver actor die, starts a new one from the run's last checkpoint and hands it what it saw (when the
loss was seen, the step the lost driver was running). The new driver completes the record: how long its start took
(``recovery_ms``), the step it re-runs from, and, with the first step past the one the lost driver was running, the
time the re-run took; that record goes among the step's ``recoveries``.
"""

from __future__ import annotations

import time

__all__ = ["DriverRestart"]


class DriverRestart:
    """The lost driver's recovery record: ``restarted`` as the CLI gave it (``seen_at``, ``lost_step``, ...)."""

    def __init__(self, restarted: dict):
        self._rec: dict | None = dict(restarted)
        self._set_up_at: float | None = None

    def set_up(self, from_step: int, corpus_load_s: float) -> None:
        """The new driver is set up and re-runs from ``from_step`` (its checkpoint's step) now."""
        self._set_up_at = time.time()
        self._rec["recovery_ms"] = (self._set_up_at - self._rec.pop("seen_at")) * 1e3
        self._rec["from_step"] = from_step
        self._rec["corpus_ms"] = corpus_load_s * 1e3  # the new driver's corpus load

    def lived(self, record: dict) -> None:
        """Add the recovery to ``record``'s when it is the first past the step the lost driver was running: detect,
        restart, re-run to here. Once."""
        if self._rec is None or record["step"] < self._rec["lost_step"]:
            return
        rec, self._rec = self._rec, None
        rec["rerun_ms"] = (time.time() - self._set_up_at) * 1e3
        rec["redone_steps"] = record["step"] - rec["from_step"]
        rec["total_ms"] = rec.get("detect_ms", 0.0) + rec["recovery_ms"] + rec["rerun_ms"]
        record["recoveries"] = [*record["recoveries"], rec]
