"""The driver's checkpointer: writes the run's checkpoints and knows the step of the newest one on disk.

A checkpoint is written every ``checkpoint_every`` steps (``control.step_callbacks.CheckpointCallback``), at the
run's end, when the driver's own node is drained, and after an error from the members that hold the last completed
step (``control.emergency``). The store on disk, its names and what a resume reads are
``control.checkpoint.RunCheckpoints``; this component decides nothing, it executes the driver's saves and keeps
what the end of the run and the emergency save ask: which step the newest checkpoint holds, and where it is.
"""

from __future__ import annotations

from collections.abc import Callable

from flexorch.control.checkpoint import RunCheckpoints
from flexorch.control.emergency import save_after_error
from flexorch.control.group import WorkerGroup

__all__ = ["Checkpointer"]


class Checkpointer:
    """Saves through ``checkpoints``; ``driver_state`` gives what the driver keeps beside the model (the stream's
    position, the skipped batches, the config); ``publish`` reports each save."""

    def __init__(self, checkpoints: RunCheckpoints, driver_state: Callable[[], dict], publish: Callable[[dict], None]):
        self.checkpoints = checkpoints
        self._driver_state = driver_state
        self._publish = publish
        self.at: int | None = None
        """The step of the newest checkpoint this run has on disk (written or resumed from); None: none yet."""
        self.last: str | None = None
        """Where that checkpoint is."""

    def resumed(self, step: int) -> None:
        """The run resumed from its checkpoint of ``step``: that one is on disk already."""
        self.at, self.last = step, str(self.checkpoints.own.path)

    def save(self, step: int, workers: WorkerGroup) -> str:
        """Write the checkpoint after ``step`` steps (model state assembled from ``workers``, or every worker's own
        shard when the model state is sharded); returns its path."""
        driver_state = self._driver_state()
        if workers.sharded:  # every worker writes its own shard
            path = self.checkpoints.save(step, None, driver_state, write_shards=workers.save_sharded)
        else:
            path = self.checkpoints.save(step, workers.get_state(0), driver_state)
        self.at, self.last = step, path
        self._publish({"event": "checkpoint", "step": step, "path": path})
        return path

    def at_end(self, step: int, workers: WorkerGroup) -> str:
        """The checkpoint of the run's end after ``step`` steps: a periodic one of that step is kept."""
        return self.last if self.at == step else self.save(step, workers)

    def keep_work(self, e: Exception, step: int, workers: WorkerGroup | None, resume: str) -> Exception:
        """The run stops on ``e`` after ``step`` steps: write a checkpoint of the state after the last completed step
        from the members that hold it (``control.emergency``); the error to raise says where it is, or why there is
        none. ``resume``: the command to go on with."""
        hint = self.checkpoints.hint()  # what the error says about checkpoints (ElasticError appends it)
        path, note = save_after_error(
            workers,
            step,
            checkpointed_at=self.at,
            last_checkpoint=self.last,
            save=lambda: self.save(step, workers),
            resume=resume,
        )
        if path is not None:
            self._publish({"event": "emergency_checkpoint", "step": step, "path": path})
        text = str(e)
        text = text.replace(hint, note) if hint in text else f"{text.rstrip('. ')}. {note}"
        try:
            return type(e)(text)
        except Exception:  # noqa: BLE001 - an exception class that takes other arguments
            return RuntimeError(text)
