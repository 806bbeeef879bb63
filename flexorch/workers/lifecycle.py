"""A worker process's life beside its steps: the heartbeat the driver watches, a SIGTERM taken as a notice to leave,
and a quiet exit once it has left.

A component of the worker actor (``flexorch.workers.actor.Worker``), which answers ``start_heartbeat``,
``stop_heartbeat`` and ``retire`` with it (the last two on its control thread). Imports without Ray, as the rest of
the data plane.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from datetime import timedelta

import torch.distributed as dist

__all__ = ["HEARTBEAT_S", "WorkerLifecycle"]

HEARTBEAT_S = 1.0
"""How often a worker's heartbeat thread beats (:meth:`WorkerLifecycle.start_heartbeat`)."""


class WorkerLifecycle:
    """Heartbeat, SIGTERM notice and retirement of worker ``worker_id``. ``in_actor``: this process is a Ray actor's,
    so SIGTERM is taken by :meth:`_on_sigterm` (from the main thread) instead of Ray's handler, which exits the
    process at once; a test's in-process worker leaves the test's signals alone."""

    def __init__(self, worker_id: int, in_actor: bool = False):
        self.worker_id = worker_id
        self._sigterm_at: float | None = None  # when this process got SIGTERM (unix seconds), if it did
        self._beat: threading.Thread | None = None
        self._beat_stop = threading.Event()
        if in_actor and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def start_heartbeat(self, host: str, port: int, period_s: float = HEARTBEAT_S) -> None:
        """Beat every ``period_s`` into the driver's heartbeat store (``beat/<worker id>``, a counter), from a
        thread beside the steps and outside the collectives, so the driver tells a hung worker (SIGSTOP, a deadlock
        outside Python) from a slow one. The same thread ends this process at once when its raylet is gone (its
        parent changed): a worker orphaned by its node's raylet would otherwise keep its gloo sockets open, and its
        peers would wait on it until their collective timeout."""
        if self._beat is not None:
            return
        parent = os.getppid()
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30.0))
        key = f"beat/{self.worker_id}"
        stop = self._beat_stop

        def beat() -> None:
            announced = False
            while not stop.is_set():
                if os.getppid() != parent:  # the raylet that started this worker died: so does its worker
                    os._exit(1)
                try:
                    store.add(key, 1)
                    if self._sigterm_at is not None and not announced:  # its notice, for the driver's drain watch
                        store.set(f"leave/{self.worker_id}", repr(self._sigterm_at))
                        store.add("leaving", 1)
                        announced = True
                except Exception:  # noqa: BLE001 - the driver's store is gone (the run ended): stop beating
                    return
                stop.wait(0.05 if self._sigterm_at is not None and not announced else period_s)

        self._beat = threading.Thread(target=beat, name="flexorch-heartbeat", daemon=True)
        self._beat.start()

    def _on_sigterm(self, signum, frame) -> None:
        """SIGTERM, a notice that this process goes soon, is only noted here; the heartbeat tells the driver, which
        takes this worker out at the next boundary (``control.drains``), or the platform's SIGKILL comes first."""
        if self._sigterm_at is None:
            self._sigterm_at = time.time()

    def stop_heartbeat(self, timeout_s: float = 5.0) -> bool:
        """Stop beating and wait for the thread (the run is ending and the driver closes the store next: a beat
        into a closed store is a caught error, but c10d first prints a C++ stack trace to the worker's stderr,
        which Ray forwards to the user's console at the end of a run that went well). True once it has stopped."""
        beat = self._beat
        if beat is None:
            return True
        self._beat_stop.set()
        beat.join(timeout_s)
        return not beat.is_alive()

    def freeze_for_exit(self) -> int:
        """This worker has left the run (its node is being drained) and is killed next: move every object into
        the collector's permanent generation (``gc.freeze``), so the collection that ran on the way out, seen
        under Ray's kill of a worker holding a model, finds nothing to scan. Without it, such a worker spends CPU
        collecting before it dies, on cores the workers that stay may be running their next step on (nodes that
        share a machine; on a real cluster it is the draining node's own CPU). Returns the objects frozen."""
        gc.freeze()
        return gc.get_freeze_count()
