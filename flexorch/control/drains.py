"""Nodes that are going away on notice: Ray's drain requests, as the driver sees them.

A spot instance's preemption notice, an autoscaler's scale-down and ``ray drain-node --reason
DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N`` all reach Ray as one drain request with a reason and a
deadline, and the GCS keeps the list of draining nodes with their deadlines. Ray 2.60 has no public API for that
list (``ray.util.state.list_nodes`` says ``ALIVE`` until the node is dead, and needs the dashboard); the GCS call
``ray._private.state.state.get_draining_nodes()`` has it, and Ray's own Train v2 (``PreemptionWatcher``) and Data
read the same call. This module is the one place flexorch touches it; ``tests/cluster/test_drain_cluster.py`` pins it
against a real multi-node Ray.

The GCS keeps a drain's reason but no read API returns it while the node lives. For the nodes that matter it is
still known: a raylet accepts a drain for idle termination only when the node is idle, and a node holding a run's
worker actors (one CPU or GPU each) never is, so every drain accepted on such a node is a preemption (the only other
reason Ray has). :class:`DrainWatch` says so for those nodes and ``"unknown"`` for others.

:class:`DrainWatch` asks every ``interval_s`` (0.5 s) from a thread beside the steps, so the driver knows of a drain
within a second even while a step runs, stamps when it first saw each one and says so at once; the elastic executor
(``control.elastic``) takes the drains of its members' nodes at the next step boundary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["NodeDrain", "DrainWatch", "draining_nodes", "free_slots_on_draining", "POLL_S"]

POLL_S = 0.5
"""How often :class:`DrainWatch` asks for draining nodes: a drain is seen within this (plus one GCS call)."""


@dataclass(frozen=True)
class NodeDrain:
    """A node being drained: ``deadline`` (unix seconds; None: no deadline, Ray's 0), ``reason`` in words
    (``"preemption"``, or ``"unknown"`` where Ray does not say), ``ip`` (None where unknown), ``seen_at`` (unix
    seconds the driver first saw it)."""

    node_id: str
    deadline: float | None
    reason: str = "unknown"
    ip: str | None = None
    seen_at: float | None = None

    def left_s(self, now: float | None = None) -> float | None:
        """Seconds until the deadline (negative once passed); None without a deadline."""
        if self.deadline is None:
            return None
        return self.deadline - (time.time() if now is None else now)

    @property
    def name(self) -> str:
        """How the console names the node: its IP, else the start of its id."""
        return self.ip or self.node_id[:12]

    def fields(self) -> dict:
        """The drain's part of a ``drain`` recovery record."""
        return {
            "node": self.node_id,
            "node_ip": self.ip,
            "reason": self.reason,
            "deadline": self.deadline,
            "seen_at": self.seen_at,
        }


def draining_nodes() -> list[NodeDrain]:
    """Nodes of the connected Ray cluster being drained, with their deadlines and IPs (one GCS call; the IPs from
    ``ray.nodes()`` only when some node drains)."""
    import ray
    from ray._private import state

    deadlines = state.state.get_draining_nodes()  # {node id hex: deadline ms, 0: none}
    if not deadlines:
        return []
    ips = {n["NodeID"]: n.get("NodeManagerAddress") for n in ray.nodes()}
    return [
        NodeDrain(node, ms / 1e3 if ms else None, "unknown", ips.get(node)) for node, ms in sorted(deadlines.items())
    ]


def free_slots_on_draining(key: str) -> float:
    """Free ``key`` slots (``"CPU"``, ``"GPU"``) on draining nodes: Ray places nothing new there, so a run counting
    free slots to grow onto must leave them out."""
    from ray._private import state

    deadlines = state.state.get_draining_nodes()
    if not deadlines:
        return 0.0
    free = state.state.available_resources_per_node()
    return float(sum(free.get(node, {}).get(key, 0.0) for node in deadlines))


class DrainWatch:
    """The drains a run has seen: polled from a thread (:meth:`start`) and at each step boundary (:meth:`poll`).

    ``source``: () -> [NodeDrain] (the worker group's ``draining_nodes``); ``members``: () -> {worker id: node id}
    of the run's workers; ``publish`` gets ``{"event": "drain_seen", ...}`` once per drain on a member's node, the
    moment it is first seen. Each member on a draining node is handed out once (:meth:`take`): a worker that joined
    on a node after its drain was handed out comes with the next take."""

    def __init__(
        self,
        source: Callable[[], list[NodeDrain]],
        members: Callable[[], Mapping[int, str]],
        publish: Callable[[dict], None],
        interval_s: float = POLL_S,
        own_node: str | None = None,
        notices: Callable[[], Mapping[int, float]] | None = None,
        grace_s: float = 30.0,
    ):
        self._source, self._members, self._publish = source, members, publish
        self._notices = notices
        """() -> {worker id: unix seconds it got SIGTERM}: a worker's own notice, a drain of that worker alone with
        the deadline ``grace_s`` after the signal (the worker group's ``leaving_notices``)."""
        self.grace_s = grace_s
        self.own_node = own_node
        """The node the driver runs on (None: unknown): its drain is announced as such."""
        self.own_drain: NodeDrain | None = None
        """The drain of :attr:`own_node`, once seen."""
        self.interval_s = interval_s
        self._seen: dict[str, NodeDrain] = {}  # node id -> the drain as first seen
        self._taken: set[tuple[str, int]] = set()  # (node, worker) pairs handed out
        self._signalled: dict[int, NodeDrain] = {}  # worker id -> its SIGTERM notice as a drain of its node
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0
        """Polls that failed (the GCS briefly unreachable): the next one tries again."""
        self.on_seen: Callable[[list[int]], None] | None = None
        """Called with a drain's members the moment it is first seen (the driver solves the smaller world's plan)."""

    def poll(self) -> list[NodeDrain]:
        """Ask once; stamp and announce drains not seen before. Returns every drain seen so far."""
        now = time.time()
        try:
            current = self._source()
            members = dict(self._members())
            signalled = dict(self._notices()) if self._notices is not None else {}
        except Exception:  # noqa: BLE001 - a GCS hiccup, or members changing under the thread: next poll
            self.errors += 1
            return list(self._seen.values())
        self._note_signals(signalled, members, now)
        fresh = []
        with self._lock:
            for drain in current:
                if drain.node_id not in self._seen:
                    held = drain.node_id in members.values()  # busy workers: only a preemption drain is accepted
                    reason = "preemption" if held and drain.reason == "unknown" else drain.reason
                    drain = NodeDrain(drain.node_id, drain.deadline, reason, drain.ip, now)
                    self._seen[drain.node_id] = drain
                    fresh.append(drain)
            seen = list(self._seen.values())
        for drain in fresh:
            if drain.node_id == self.own_node:
                self.own_drain = drain
                left = drain.left_s(now)
                when = "no deadline" if left is None else f"{max(left, 0.0):.0f} s"
                self._publish({"event": "progress", "message": (
                    f"node {drain.name}, which runs the driver, is draining ({drain.reason}, {when}): the driver does "
                    "not move; it writes a checkpoint at the next step boundary, and when the node goes `flexorch "
                    "train` starts a new driver from the newest checkpoint")})  # fmt: skip
            workers = sorted(w for w, n in members.items() if n == drain.node_id)
            if workers:
                self._publish(
                    {"event": "drain_seen", **drain.fields(), "workers": workers, "left_s": drain.left_s(now)}
                )
                self._seen_members(workers)
        return seen

    def _seen_members(self, workers: list[int]) -> None:
        if self.on_seen is not None:
            try:
                self.on_seen(workers)
            except Exception:  # noqa: BLE001 - a hint to the planner: the leave itself does not depend on it
                self.errors += 1

    def _note_signals(self, signalled: Mapping[int, float], members: Mapping[int, str], now: float) -> None:
        """Stamp and announce members that got SIGTERM since the last poll, each as a drain of its node that only
        it leaves by."""
        fresh = []
        with self._lock:
            for w, at in signalled.items():
                if w in members and w not in self._signalled:
                    self._signalled[w] = NodeDrain(members[w], at + self.grace_s, "sigterm", None, now)
                    fresh.append((w, self._signalled[w]))
        for w, drain in fresh:
            self._publish({"event": "drain_seen", **drain.fields(), "workers": [w], "left_s": drain.left_s(now)})
            self._seen_members([w])

    def take(self, members: Mapping[int, str]) -> list[tuple[NodeDrain, list[int]]]:
        """Drains of nodes holding some of ``members`` ({worker id: node id}), soonest deadline first, each with its
        members not handed out before (a SIGTERM notice: that worker alone); polls first."""
        self.poll()
        out = []
        with self._lock:
            for node, drain in self._seen.items():
                on = sorted(w for w, n in members.items() if n == node and (node, w) not in self._taken)
                if on:
                    self._taken |= {(node, w) for w in on}
                    out.append((drain, on))
            for w, drain in sorted(self._signalled.items()):
                if w in members and (drain.node_id, w) not in self._taken:
                    self._taken.add((drain.node_id, w))
                    out.append((drain, [w]))
        return sorted(out, key=lambda d: (d[0].deadline is None, d[0].deadline or 0.0))

    def draining(self, node_id: str) -> NodeDrain | None:
        """The drain of ``node_id`` if it was seen."""
        with self._lock:
            return self._seen.get(node_id)

    def start(self) -> None:
        """Poll every ``interval_s`` from a daemon thread until :meth:`close`."""
        if self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                self.poll()

        self._thread = threading.Thread(target=loop, name="flexorch-drain-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1.0)
            self._thread = None
