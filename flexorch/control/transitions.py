"""What one :meth:`TrainingDriver.step <flexorch.control.driver.TrainingDriver.step>` did, as a value.

A step is one transition of the driver's state (step number, stream position, world, parameters): the batch was
trained, skipped (no plan fits it and ``plan.on_infeasible = "skip"``), or the run went back to its last checkpoint
(stage-local parameters whose every holder was lost). ``step`` never calls itself: after a roll-back the next call
trains the checkpoint's next batch. Tests assert the state after each transition; ``run`` loops them and
publishes progress to an :class:`EventLog` the CLI polls.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

__all__ = ["EventLog", "Ran", "StepRun", "Transition"]


class Ran(enum.Enum):
    """What a step did."""

    TRAINED = "trained"
    SKIPPED = "skipped"
    ROLLED_BACK = "rolled_back"


@dataclass(frozen=True)
class Transition:
    """One step's outcome: what ran, its record, and the membership changes made on the way."""

    ran: Ran
    step: int
    """The driver's step number when the transition began (the step trained or skipped, or the one given up)."""
    next_step: int
    """The driver's step number after it: ``step + 1``, or a roll-back's checkpoint step."""
    record: dict | None
    """The record written to ``steps.jsonl`` (trained or skipped); None after a roll-back (nothing was recorded:
    the roll-back is recorded among the ``recoveries`` of the next step's record)."""
    recoveries: tuple[dict, ...] = ()
    """Membership changes made during this transition, in order (the membership records of
    :class:`~flexorch.control.elastic.Elastic`, and the roll-back's), each with ``what`` and the worlds before and
    after."""

    def __post_init__(self) -> None:
        if not isinstance(self.ran, Ran):
            raise TypeError(f"Transition.ran must be a Ran, got {self.ran!r}")
        if (self.record is None) != (self.ran is Ran.ROLLED_BACK):
            raise ValueError(f"a {self.ran.value} transition {'has no' if self.record is None else 'has a'} record")
        if self.ran is not Ran.ROLLED_BACK and self.next_step != self.step + 1:
            raise ValueError(
                f"a {self.ran.value} transition goes from step {self.step} to {self.step + 1}, not {self.next_step}"
            )

    @property
    def decisions(self) -> tuple[str, ...]:
        """The elastic policy's decisions executed during this transition (``Shrink``, ``Retry``, ...), in order."""
        return tuple(d for rec in self.recoveries for d in rec.get("decisions", ()))

    @property
    def rolled_back(self) -> bool:
        return self.ran is Ran.ROLLED_BACK


class EventLog:
    """Progress events (dicts with an ``event`` key) appended by the run, read by another thread (the CLI's poll)."""

    def __init__(self):
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self.done = False

    def publish(self, event: dict) -> None:
        with self._lock:
            self._events.append(event)

    def poll(self, since: int) -> tuple[list[dict], bool]:
        """Events after index ``since`` and whether the run has ended."""
        with self._lock:
            return self._events[since:], self.done


@dataclass
class StepRun:
    """One step's batch across its attempts: the lengths, the recoveries recorded with it so far (those carried
    from the boundary first), the attempt number, and the times a recovery's re-run is measured from."""

    batch: object
    lengths: list[int]
    recoveries: list[dict]
    attempt: int = 0
    task_epochs: list | None = None
    mixed: dict | None = None
    rerun_from: float = 0.0
    t_done: float = 0.0

    def base_fields(self, step: int, n: int, workers, planned, mode: str, plan_wait_ms: float, boundary_ms: float):
        """The record fields every outcome of an attempt at the batch has: the batch, the world of ``n`` workers it
        runs on (``workers``' members), what its plan (``planned``) cost to get, and the recoveries so far."""
        batch = self.batch
        return {
            "step": step,
            "epoch": batch.epoch,
            "batch_index": batch.index_in_epoch,
            "doc_ids": list(batch.doc_ids),
            "seq_lengths": self.lengths,
            "world_size": n,
            "worker_ids": list(workers.worker_ids),
            "nodes": workers.rank_nodes(),
            "mode": mode,
            "solve_s": planned.solve_s,
            "plan_wait_ms": plan_wait_ms,
            "boundary_ms": boundary_ms,
            "baselines_ms": planned.baselines_ms,
            "recoveries": self.recoveries,
        }
