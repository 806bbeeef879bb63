"""Ask the cluster's autoscaler for the workers the run lost (``[elastic] request_capacity``).

A run that lost workers (a dead or drained node) goes on with the world left and grows back when free slots appear
(``control.elastic``). On a cluster with an autoscaler, nothing makes those slots appear: the run's actors are not
pending, so the autoscaler sees no demand, and an idle cluster is never scaled back up. So while the world is smaller
than it has been (capped at ``max_workers``), the driver asks the autoscaler for it through Ray's public
``ray.autoscaler.sdk.request_resources``: one bundle per worker of that world, the shape of a worker actor. The
request is for the cluster's capacity, not on top of what runs (Ray packs requested bundles against the nodes' total
resources), so asking for the whole world keeps the survivors' nodes and adds what the missing workers need. It is
withdrawn (an empty request) once the world is whole again and when the run ends, so that it does not hold nodes up
after it. Without an autoscaler the request is a key in the GCS that nobody reads.

:class:`CapacityRequest` decides and says what it did; the call itself is injected (``request``), so the fake worker
group tests the decisions and one test pins the real call's effect on the GCS.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

__all__ = ["LOCAL_RAY_ENV", "CapacityRequest", "ray_request", "run_capacity", "worker_bundle"]

LOCAL_RAY_ENV = "FLEXORCH_LOCAL_RAY"
"""Set to "1" in every process of the local Ray that ``flexorch train`` starts for a run (``cli.train.ray_session``):
no autoscaler there, so 'auto' asks for nothing."""


def worker_bundle(use_gpu: bool) -> dict[str, float]:
    """The resources of one worker actor (``control.worker_start``): a CPU, and a GPU on GPU runs."""
    return {"CPU": 1.0, "GPU": 1.0} if use_gpu else {"CPU": 1.0}


def ray_request(bundles: list[dict[str, float]]) -> None:
    """Set the cluster's requested capacity to ``bundles`` (empty: withdraw the request)."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)


class CapacityRequest:
    """The run's standing request for the workers it lost: made when the world shrinks below the largest it has
    had (at most ``max_workers``), withdrawn when it is whole again (:meth:`update`) or the run ends
    (:meth:`close`)."""

    def __init__(
        self,
        bundle: dict[str, float],
        max_workers: int,
        request: Callable[[list[dict[str, float]]], None] = ray_request,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bundle = dict(bundle)
        self.max_workers = max_workers
        self._request = request
        self._clock = clock
        self.wanted = 0
        """The world the run asks to be back to: the largest it has had, at most ``max_workers``."""
        self.requested = 0
        """Workers' bundles asked for now (0: no request stands)."""
        self.since: float | None = None
        """When the standing request was made (``clock``)."""

    def await_start(
        self, workers: int, timeout_s: float, slots: Callable[[], float], publish=None, poll_s: float = 0.5
    ) -> None:
        """Before the workers start: when the cluster has fewer than ``workers`` slots (``slots()``: its total, e.g.
        an autoscaled cluster scaled to zero), ask for them, say so (``publish``) and wait up to ``timeout_s`` for
        them to appear. The request stands until the world is whole (:meth:`update`); a cluster still short after
        ``timeout_s`` is the worker group's to judge (it fails below ``min_workers``, starts smaller otherwise)."""
        self.wanted = min(self.max_workers, max(self.wanted, workers))
        have = slots()
        if have >= self.wanted:
            return
        self._request([dict(self.bundle) for _ in range(self.wanted)])
        self.requested, self.since = self.wanted, self._clock()
        if publish is not None:
            publish({
                "event": "capacity", "requested": self.wanted, "missing": self.wanted - int(have),
                "message": f"the cluster has {have:g} of the {self.wanted} workers' slots: asked its autoscaler for "
                f"them ({self._shape()} each), waiting up to {timeout_s:g} s",
            })  # fmt: skip
        deadline = self._clock() + timeout_s
        while slots() < self.wanted and self._clock() < deadline:
            time.sleep(poll_s)

    def _shape(self) -> str:
        return ", ".join(f"{k} {v:g}" for k, v in sorted(self.bundle.items()))

    def update(self, size: int) -> dict | None:
        """At a step boundary, with ``size`` workers in the world: ask for the missing ones, or withdraw the request
        once they are back. Returns an event (``{"event": "capacity", ...}`` with a one-line ``message``) when it
        asked or withdrew, else None."""
        self.wanted = min(self.max_workers, max(self.wanted, size))
        missing = self.wanted - size
        if missing > 0 and self.requested != self.wanted:
            self._request([dict(self.bundle) for _ in range(self.wanted)])
            self.requested, self.since = self.wanted, self._clock()
            return {
                "event": "capacity",
                "requested": self.wanted,
                "missing": missing,
                "message": f"asked the cluster's autoscaler for {missing} worker(s) to get back to {self.wanted} "
                f"({self._shape()} each)",
            }
        if missing <= 0 and self.requested:
            waited = self._clock() - (self.since or self._clock())
            self._withdraw()
            return {
                "event": "capacity",
                "requested": 0,
                "missing": 0,
                "waited_s": waited,
                "message": f"the world is back to {size} workers {waited:.1f} s after asking the autoscaler; "
                "request withdrawn",
            }
        return None

    def close(self) -> None:
        """The run ends: withdraw a standing request (a failure to reach the GCS is not the run's concern then)."""
        if self.requested:
            try:
                self._withdraw()
            except Exception:  # noqa: BLE001 - the cluster may be going away with the run
                self.requested, self.since = 0, None

    def _withdraw(self) -> None:
        self._request([])
        self.requested, self.since = 0, None


def run_capacity(cfg, worker_group, request) -> CapacityRequest | None:
    """The run's :class:`CapacityRequest` (``cfg``: its TrainConfig), or None when ``[elastic] request_capacity``
    is off: 'auto' is on for a Ray worker group on a cluster that ``flexorch train`` did not start itself (its own
    local Ray marks its processes with ``FLEXORCH_LOCAL_RAY``), and wherever a ``request`` is given."""
    wanted = cfg.elastic.request_capacity
    if wanted == "auto":
        wanted = request is not None or (worker_group is None and os.environ.get(LOCAL_RAY_ENV) != "1")
    if not wanted:
        return None
    if request is None:
        if worker_group is not None:
            return None  # a given (test) worker group on no cluster: nothing to ask
        request = ray_request
    return CapacityRequest(worker_bundle(cfg.use_gpu), cfg.max_workers, request)
