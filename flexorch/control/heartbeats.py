"""The driver's side of the workers' heartbeats (``Worker.start_heartbeat``, ``flexorch.workers.lifecycle``): a store
they count beats into, and who has gone silent for how long.

Each worker's thread adds 1 to ``beat/<worker id>`` once a second, outside the collectives, so a worker that is
merely slow (a long step, a big all-to-all) keeps beating while one that is frozen (SIGSTOP, a node powered off or
cut off) stops. The driver reads the counts while it waits on a step (``RayWorkerGroup.settle``); a count that has
not moved for the limit declares the worker hung. The same idea as torchft's heartbeats to its lighthouse.
"""

from __future__ import annotations

import time

import torch.distributed as dist

__all__ = ["Heartbeats"]


class Heartbeats:
    """Beat counts of the run's workers in a ``TCPStore`` on the driver's host (it lives as long as the run)."""

    def __init__(self, host: str, timeout_s: float):
        self.timeout_s = timeout_s
        """Silence after which a worker is declared hung (``[elastic] heartbeat_timeout_s``; 0: not watched)."""
        self.host = host
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self.port = self._store.port
        self._seen: dict[int, tuple[int, float]] = {}  # worker id -> (beats, when that count was first seen)

    def counts(self, worker_ids) -> dict[int, int]:
        """Heartbeats counted so far per worker; 0 before the first."""
        return {w: int(self._store.add(f"beat/{w}", 0)) for w in worker_ids}

    def leaving(self, worker_ids) -> dict[int, float]:
        """Of ``worker_ids``, those whose process got SIGTERM (``WorkerLifecycle._on_sigterm``, announced by its
        heartbeat thread): id -> when, in unix seconds. One store call while nobody got one."""
        if int(self._store.add("leaving", 0)) == 0:
            return {}
        return {w: float(self._store.get(f"leave/{w}")) for w in worker_ids if self._store.check([f"leave/{w}"])}

    def beating(self, worker_id: int) -> bool:
        """Whether the worker's heartbeat moved within ``timeout_s`` (False when it never beat or not watched)."""
        if not self.timeout_s:
            return False
        n = self.counts([worker_id])[worker_id]
        seen = self._seen.get(worker_id)
        fresh = seen is None or seen[0] != n or time.monotonic() - seen[1] <= self.timeout_s
        return n > 0 and fresh

    def silent(self, worker_ids, limit_s: float | None = None) -> dict[int, float]:
        """Of ``worker_ids``, those whose heartbeat has not moved for ``limit_s`` (default ``timeout_s``): id ->
        seconds silent. A worker that has never beaten (its thread not started yet, or a class without one) is not
        judged."""
        limit_s = self.timeout_s if limit_s is None else limit_s
        now = time.monotonic()
        out = {}
        for w, n in self.counts(worker_ids).items():
            seen = self._seen.get(w)
            if seen is None or seen[0] != n:
                self._seen[w] = (n, now)
            elif n > 0 and now - seen[1] > limit_s:
                out[w] = now - seen[1]
        return out

    def detection(self, lost, failed_at: float | None, silent) -> dict | None:
        """How a failure seen at ``failed_at`` (``time.monotonic()``) was found: ``{"by": "heartbeat" | "ray",
        "detect_ms", "since_ms"}``: from the lost workers' last heartbeat (their last sign of life the driver saw)
        to the failure seen, and from then to now (the survivors leaving the broken world, part of re-forming);
        None when no failure was seen or the lost workers were never heard from. ``silent``: the workers declared
        hung by their heartbeat."""
        lost = [w for w in lost if w in self._seen]
        if failed_at is None or not lost:
            return None
        last = min(self._seen[w][1] for w in lost)
        by = "heartbeat" if set(lost) & set(silent) else "ray"
        since = (time.monotonic() - failed_at) * 1e3
        return {"by": by, "detect_ms": max(0.0, failed_at - last) * 1e3, "since_ms": since}
