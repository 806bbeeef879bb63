"""A checkpoint's files written by a worker itself, straight to the checkpoint's storage (a local or shared directory,
or an object-store URI: ``flexorch.data.store.remote``'s pyarrow filesystems), now or from a background thread.

A replicated run's worker holding the whole model writes ``model.pt`` and ``train_state.pt``
(:func:`write_state_files`), so 100s of MB of state never travel to the driver; a sharded run's workers copy the DCP
files they staged in host memory (``workers.sharded_checkpoint.stage_sharded``). :class:`BackgroundWrite` runs
either on a thread of the worker while it trains the next steps; the driver waits for it through the actor's ``io``
concurrency group (``control.checkpointer``). No process group is used here.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable

import torch

from flexorch.data.store.remote import filesystem, is_remote

__all__ = ["BackgroundWrite", "without_zip_crc", "write_state_files"]


WRITER_NICE = 10
"""How much lower than training a background write's thread runs (Linux niceness, per thread): the step's own threads
come first, and the write takes what CPU they leave (their waits on collectives, the driver's planning). A write
still running when the next save begins is waited for then, so it cannot fall behind for good."""


def _yield_to_training() -> None:
    """Lower this thread's CPU priority by :data:`WRITER_NICE` (Linux: ``setpriority`` on a thread id applies to that
    thread alone); elsewhere, or where refused, the thread runs as it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + WRITER_NICE)
    except (AttributeError, OSError):
        pass


def write_state_files(directory: str, state: dict) -> dict[str, str]:
    """Write a replicated state (``ReplicatedState.get_state``: model, optimizer, scheduler, rng) as ``model.pt``
    and ``train_state.pt`` into ``directory``; returns each file's SHA-256 (of the bytes written)."""
    fs, path = filesystem(directory)
    if not is_remote(directory):
        fs.create_dir(path, recursive=True)
    train = {k: state[k] for k in ("optimizer", "scheduler", "rng")}
    hashes = {}
    for name, obj in (("model.pt", state["model"]), ("train_state.pt", train)):
        with fs.open_output_stream(f"{path}/{name}") as f, without_zip_crc():
            out = _HashingWriter(f)
            torch.save(obj, out)  # streamed: no whole-file copy in memory (150 MB cost 210 ms in a BytesIO)
        hashes[name] = out.sha256.hexdigest()
    return hashes


def without_zip_crc():
    """``torch.save`` (and DCP, which saves each tensor with it) without the CRC-32 of each zip record, inside the
    block (``torch.utils.serialization.config``): the manifest's SHA-256 or sizes check the files, and the CRC cost
    100 of the 155 ms of CPU ``torch.save`` took for 150 MB here (``torch.load`` reads such files as any other). A
    worker saves nothing else meanwhile: its saves are one at a time."""
    import torch.utils.serialization as serialization

    return serialization.config.patch({"save.compute_crc32": False})


class _HashingWriter:
    """A binary output stream that hashes (SHA-256) the bytes as they are written through it."""

    def __init__(self, stream):
        self._stream = stream
        self.sha256 = hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self._stream.write(data)

    def flush(self) -> None:
        self._stream.flush()


class BackgroundWrite:
    """``write()`` run on a thread of its own; :meth:`wait` gives its result or raises why it failed, naming
    ``directory``. ``cleanup`` runs after it either way (a staging directory deleted)."""

    def __init__(self, write: Callable[[], dict], directory: str, cleanup: Callable[[], None] | None = None):
        self.directory = directory
        self._write, self._cleanup = write, cleanup
        self.result: dict | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="flexorch-checkpoint-write", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        _yield_to_training()
        try:
            self.result = self._write()
        except BaseException as e:  # noqa: BLE001 - reported to the driver by wait()
            self.error = e
        finally:
            if self._cleanup is not None:
                self._cleanup()

    def wait(self, timeout_s: float | None = None) -> dict:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"writing this worker's part of {self.directory} still runs after {timeout_s} s")
        if self.error is not None:
            raise RuntimeError(
                f"writing this worker's part of {self.directory} failed: {type(self.error).__name__}: {self.error}"
            ) from self.error
        return self.result
