"""The time this process spends blocked in its SP groups' collectives: the ring's hops (``ring._InFlight.wait``) and
Ulysses' all-to-alls (``ulysses``), so a rank's own pace can be told from its group's.

A group's micro-batch takes as long as its slowest member (every member waits for it at each hop and all-to-all),
so the group's time says the group was slow, not which member was. What a member did not spend blocked is its own
work: the member that set the pace blocked least, the others blocked for it. ``solver.worker_speeds`` compares
them (the ranks' ``wait_ms``) to find the slow member of a group whose members always ran together, which the
groups' times alone cannot (Megatron-LM's straggler detector times each rank's own compute for the same reason).

Only where the collectives block the host: over gloo (CPU tensors) a call returns once the data is there. NCCL
calls return when enqueued, so on a GPU the time here is not a wait and the executor does not report it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

__all__ = ["WAITS", "CollectiveWaits"]


class CollectiveWaits:
    """Seconds blocked in SP collectives since the last :meth:`take_ms` (one per process: a worker runs its step's
    collectives from one thread)."""

    def __init__(self) -> None:
        self._s = 0.0

    @contextmanager
    def blocked(self):
        """Time the block as waiting on the group."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._s += time.perf_counter() - t0

    def take_ms(self) -> float:
        """Milliseconds blocked since the last call; starts the count again."""
        s, self._s = self._s, 0.0
        return s * 1e3


WAITS = CollectiveWaits()
