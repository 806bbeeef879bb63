"""A run's loop and end (``TrainingDriver.run``): step until done or asked to stop, write checkpoints, keep the work
of a run that stops on an error (``control.emergency``), report events, shut the workers and the planner down.

:class:`RunLoop` is a part of :class:`~flexorch.control.driver.TrainingDriver` (its base class), kept apart so that
each file holds one job: ``control.run_setup`` the start, ``control.driver`` the step transition, this one the loop
around it. It reads and sets the driver's attributes (``step_no``, ``stream``, ``workers``, ``checkpoints``,
``records``, ``trackers``, ``events``, ``revisions``, ``elastic``, ``planner``).
"""

from __future__ import annotations

from flexorch.control.emergency import save_after_error

__all__ = ["RunLoop"]


class RunLoop:
    """The loop, checkpoints, events and shutdown of a run, as methods of the driver (see the module's docstring)."""

    def request_stop(self, reason: str) -> None:
        """Stop after the step in flight (a signal: SIGTERM from ``ray job stop`` or a preemption, SIGINT from
        Ctrl-C): :meth:`run` then writes a checkpoint and returns with ``stopped`` set."""
        if self._stop_reason is None:
            self._stop_reason = reason
            self._publish(
                {
                    "event": "progress",
                    "message": f"{reason}: stopping after step {self.step_no + 1} (the one in "
                    "flight), then writing a checkpoint",
                }
            )

    def checkpoint(self) -> str:
        """Write this run's checkpoint after :attr:`step_no` steps (model state assembled from the workers)."""
        driver_state = {
            "stream": self.stream.state_dict(),
            "skipped_batches": self.skipped_batches,
            "config": self.cfg.to_dict(),
        }
        if getattr(self.workers, "sharded", False):  # every worker writes its own shard
            path = self.checkpoints.save(self.step_no, None, driver_state, write_shards=self.workers.save_sharded)
        else:
            path = self.checkpoints.save(self.step_no, self.workers.get_state(0), driver_state)
        self._checkpointed_at = self.step_no
        self._last_checkpoint = path
        self._publish({"event": "checkpoint", "step": self.step_no, "path": path})
        return path

    def run(self) -> dict:
        """Step until ``steps`` are done, checkpoint at the end; errors are published, then raised."""
        try:
            if self.workers is None:
                self.setup()
            while not self.finished and self._stop_reason is None:
                self.step()  # a roll-back goes back to the checkpoint's step: the loop trains it again
            # a stop right after a periodic checkpoint keeps that one
            path = self._last_checkpoint if self._checkpointed_at == self.step_no else self.checkpoint()
            summary = {
                "event": "done",
                "steps": self.step_no,
                "skipped_batches": self.skipped_batches,
                "checkpoint": path,
                "records": str(self.records.path),
                "stopped": self._stop_reason,
            }
            self._publish(summary)
            return summary
        except Exception as e:
            if self._closing:  # shutdown() took the workers away under the loop: that is not the run's error
                self._publish({"event": "stopped", "step": self.step_no})
                return {"event": "stopped", "steps": self.step_no, "stopped": self._stop_reason or "shutdown"}
            err = self._keep_work(e) if self.planner is not None else e  # set up: the loop had begun
            self._error = f"{type(err).__name__}: {err}"
            self._publish({"event": "error", "error": self._error})
            if err is e:
                raise
            raise err from e
        finally:
            if self.trackers is not None:  # after the error event: a failed run is marked failed in its trackers
                self.trackers.close(failed=self._error is not None)
            self.events.done = True

    def _keep_work(self, e: Exception) -> Exception:
        """The run stops on ``e``: write a checkpoint of the state after the last completed step from the members
        that hold it (``control.emergency``); the error to raise says where it is, or why there is none."""
        hint = self.checkpoints.hint()  # what the error says about checkpoints (ElasticError appends it)
        resume = f"go on with `flexorch train --config {self.run_dir}/config.json --resume`"
        path, note = save_after_error(
            self.workers,
            self.step_no,
            checkpointed_at=self._checkpointed_at,
            last_checkpoint=self._last_checkpoint,
            save=self.checkpoint,
            resume=resume,
        )
        if path is not None:
            self._publish({"event": "emergency_checkpoint", "step": self.step_no, "path": path})
        text = str(e)
        text = text.replace(hint, note) if hint in text else f"{text.rstrip('. ')}. {note}"
        try:
            return type(e)(text)
        except Exception:  # noqa: BLE001 - an exception class that takes other arguments
            return RuntimeError(text)

    def poll(self, since: int) -> tuple[list[dict], bool]:
        """Events after index ``since`` and whether the run has ended (the CLI polls the driver actor)."""
        return self.events.poll(since)

    def replica_parameters(self) -> list:
        """Every rank's parameters (tests check the replicas are identical and match the reference)."""
        return self.workers.call("parameters_digest")

    def shutdown(self) -> None:
        """Stop the workers and the planner. Called while :meth:`run` is still going (a second Ctrl-C, the CLI
        failing), the loop is told to stop and whatever then fails in it is not reported as the run's error."""
        if not self.events.done:
            self._closing = True
            self._stop_reason = self._stop_reason or "shutdown"
        self.revisions.close()
        if getattr(self, "elastic", None) is not None:  # the drain watch's thread
            self.elastic.close()
        if self._capacity is not None:
            self._capacity.close()
        if self.trackers is not None:
            self.trackers.close()
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
        if self.planner is not None:
            self.planner.close()
            self.planner = None
