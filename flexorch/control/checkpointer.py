"""The driver's checkpointer: writes the run's checkpoints and knows the step of the newest complete one.

A checkpoint is written every ``checkpoint_every`` steps (``control.step_callbacks.CheckpointCallback``), at the
run's end, when the driver's own node is drained, and after an error from the members that hold the last completed
step (``control.emergency``). The store, its names and what a resume reads are ``control.run_checkpoints``; this
component decides nothing, it executes the driver's saves and keeps what the end of the run and the emergency save
ask: which step the newest complete checkpoint holds, and where it is.

The workers write the model state themselves, straight to the storage: a replicated run's worker that holds the
whole model writes ``model.pt`` and ``train_state.pt`` (the driver assembles the state only when no worker holds it
all: stage-local pipeline parameters), a sharded run's workers each their shard. With ``[checkpoint] async`` a
periodic save returns once the state is staged in host memory: a copy of the replicated state on its worker, a
sharded run's shards on each worker's node (``workers.sharded_checkpoint.stage_sharded``), written from a thread of
each worker while it trains on. A thread of the driver waits for them and completes the checkpoint: the driver's
state and the manifest, retention (torchtitan's and
Megatron-Core's async checkpointing stage and write the same way). At most one save is in flight: the next save, the
run's end, a stop, an emergency save, a roll-back and a member leaving at a boundary wait for it first. A save that
fails is reported (``checkpoint_failed``, with its cause), what it wrote is deleted, and the previous checkpoint stays
the newest: :attr:`at` and :attr:`last` only ever name a complete checkpoint.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from flexorch.control.checkpoint import write_model_state
from flexorch.control.emergency import save_after_error
from flexorch.control.group import WorkerGroup
from flexorch.control.run_checkpoints import RunCheckpoints

__all__ = ["UPLOAD_TIMEOUT_S", "Checkpointer"]

UPLOAD_TIMEOUT_S = 3600.0
"""How long an asynchronous save may take to reach its storage before it is abandoned as failed."""


class Checkpointer:
    """Saves through ``checkpoints``; ``driver_state`` gives what the driver keeps beside the model (the stream's
    position, the skipped batches, the config); ``publish`` reports each save."""

    def __init__(
        self,
        checkpoints: RunCheckpoints,
        driver_state: Callable[[], dict],
        publish: Callable[[dict], None],
        asynchronous: bool = False,
    ):
        self.checkpoints = checkpoints
        self._driver_state = driver_state
        self._publish = publish
        self.asynchronous = asynchronous
        self.at: int | None = None
        """The step of the newest complete checkpoint this run has (written or resumed from); None: none yet."""
        self.last: str | None = None
        """Where that checkpoint is."""
        self.failed: str | None = None
        """Why the last save that failed failed (``Type: message``); None: none has."""
        self._flight: tuple | None = None
        """The save in flight: (its step, the thread writing it, [its path or the error it failed with], the
        checkpoint being written)."""

    def resumed(self, step: int) -> None:
        """The run resumed from its checkpoint of ``step``: that one is on disk already."""
        self.at, self.last = step, str(self.checkpoints.own.path)

    def save(self, step: int, workers: WorkerGroup, wait: bool = True) -> str | None:
        """Write the checkpoint after ``step`` steps: every worker's own shard when the model state is sharded, else
        the whole model written by a worker that holds it (or assembled on the driver from the holders of its
        parts); returns its path. With asynchronous saves and ``wait`` false it returns None once the state is
        staged, and the write goes on in the background."""
        self.wait()  # at most one save in flight
        driver_state = self._driver_state()
        background = self.asynchronous
        ckpt = self.checkpoints.begin(step)
        if workers.sharded:  # every worker writes its own shard (staged in host memory first, when async)
            if background:
                uploads = workers.stage_sharded(ckpt.path)
                write = lambda: check_uploads(uploads, hashes=not ckpt.store.remote)  # noqa: E731
            else:
                workers.save_sharded(ckpt.path)
                write = dict
        else:
            written = workers.write_whole(ckpt.path, background)
            if written is not None:
                write = lambda: written(UPLOAD_TIMEOUT_S)  # noqa: E731 - the files' SHA-256
            else:  # no worker holds the whole model (stage-local parts): the driver assembles and writes it
                state = workers.get_state(0)
                write = lambda: write_model_state(ckpt, state)  # noqa: E731
        finish = lambda: self.checkpoints.complete(ckpt, driver_state, write())  # noqa: E731
        if not background:
            return self._done(step, finish())
        out: list = []

        def run() -> None:
            try:
                out.append(finish())
            except BaseException as e:  # noqa: BLE001 - reported by wait(), on the driver's thread
                out.append(e)

        thread = threading.Thread(target=run, name=f"flexorch-checkpoint-{step}", daemon=True)
        thread.start()
        self._flight = (step, thread, out, ckpt)
        return self.wait() if wait else None

    @property
    def in_flight(self) -> int | None:
        """The step of the save being written in the background, or None."""
        return None if self._flight is None else self._flight[0]

    def wait(self, why: str | None = None) -> str | None:
        """Wait for the save in flight (``why``: said on the console first, e.g. a stop); returns its path, or None
        when there is none or it failed (reported, with its cause; the previous checkpoint stays the newest)."""
        if self._flight is None:
            return None
        step, thread, out, ckpt = self._flight
        if why is not None and thread.is_alive():
            self._publish({"event": "checkpoint_wait", "step": step, "message": f"{why}: waiting for the checkpoint "
                           f"of step {step} to finish writing to {ckpt.path}"})  # fmt: skip
        thread.join()
        self._flight = None
        result = out[0] if out else RuntimeError("the checkpoint's writer ended without a result")
        if isinstance(result, BaseException):
            try:
                self.checkpoints.abandon(ckpt)
            except Exception:  # noqa: BLE001 - a partial checkpoint is never loaded; the next save deletes it
                pass
            self.failed = f"{type(result).__name__}: {result}"
            self._publish({"event": "checkpoint_failed", "step": step, "path": ckpt.path,
                           "error": self.failed, "newest": self.last})  # fmt: skip
            return None
        return self._done(step, result)

    def poll(self) -> None:
        """Complete the save in flight if it is done (between steps; never waits)."""
        if self._flight is not None and not self._flight[1].is_alive():
            self.wait()

    def _saved(self, step: int, workers: WorkerGroup) -> str:
        """:meth:`save`, waited for; a failed write raises its cause (the emergency save reports it)."""
        path = self.save(step, workers)
        if path is None:
            raise RuntimeError(f"the checkpoint's write failed ({self.failed})")
        return path

    def _done(self, step: int, path: str) -> str:
        self.at, self.last = step, path
        self._publish({"event": "checkpoint", "step": step, "path": path})
        return path

    def at_end(self, step: int, workers: WorkerGroup) -> str:
        """The checkpoint of the run's end after ``step`` steps: a periodic one of that step is kept (one still in
        flight is waited for)."""
        self.wait("the run ends")
        return self.last if self.at == step else self.save(step, workers)

    def keep_work(self, e: Exception, step: int, workers: WorkerGroup | None, resume: str) -> Exception:
        """The run stops on ``e`` after ``step`` steps: write a checkpoint of the state after the last completed step
        from the members that hold it (``control.emergency``); the error to raise says where it is, or why there is
        none. ``resume``: the command to go on with."""
        self.wait("the run stops on an error")  # a save in flight completes (or fails) before anything else
        hint = self.checkpoints.hint()  # what the error says about checkpoints (ElasticError appends it)
        path, note = save_after_error(
            workers,
            step,
            checkpointed_at=self.at,
            last_checkpoint=self.last,
            save=lambda: self._saved(step, workers),
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


def check_uploads(wait: Callable[[float], dict[int, dict[str, str]]], hashes: bool = True) -> dict[str, str]:
    """Wait for every worker's copy of its staged shard (``WorkerGroup.stage_sharded``); raises the first failure.
    Returns the files' SHA-256, taken by the workers as they copied them, for the manifest (so the driver reads
    nothing back); ``hashes`` false: none (an object store's shards are checked by their sizes,
    ``control.checkpoint``)."""
    got = wait(UPLOAD_TIMEOUT_S)
    if not any(got.values()):
        raise RuntimeError("no worker wrote a file of the checkpoint")
    return {f: h for files in got.values() for f, h in files.items()} if hashes else {}
