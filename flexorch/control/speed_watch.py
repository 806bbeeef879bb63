"""The driver's watch on each worker's speed: fed every trained step's record, it keeps the estimates, writes each
rank's speed, node and process id into the record, says on the console when a worker drops below 0.8x the others
and when it recovers, exports a Ray metric per worker, and gives the planner the ranks' speeds.

The estimate itself is ``flexorch.solver.worker_speeds.WorkerSpeeds`` (the ranks' measured micro-batch times against
the cost model's prediction for the same work, a median over recent steps, groups untangled, compile steps and a
world's first steps left out). :class:`SpeedWatch` wraps it for the control plane:

* :meth:`SpeedWatch.observe` takes a trained step's record before it is written: each ``ranks[i]`` entry gets
  ``speed`` (the worker's estimate, 3 decimals), ``node`` and ``pid`` (so a user finds the process with ``top`` or
  ``py-spy``); each ``SpeedChange`` becomes a ``speed`` event (the console prints its ``message`` once on a drop,
  once on a recovery); the gauge ``flexorch_worker_speed`` (tags ``worker``, ``node``) is set per worker
  (``records.metrics``). A record whose world differs from the last one's, or that carries a membership change,
  starts a new world (its first steps are left out; the workers gone are forgotten).
* :meth:`SpeedWatch.planning_topology` is what ``control.step_plans.StepPlans.topology`` asks: with ``[plan] speeds =
  "aware"`` and some rank off 1.0, the world's topology (one node: ``Topology.single(n)``) with each rank's planning
  speed (snapped, so plans solved ahead stay valid while a worker's speed holds); ``"blind"``: never (the estimates,
  records, console lines and metrics stay).
* :meth:`SpeedWatch.slow_workers` and :meth:`SpeedWatch.estimate` are the elastic retire's seam
  (``control.slow_retire.SlowWorkers``).

Only SP steps are measured (a pipelined step's ranks report ops, not groups). With GPU workers, the accelerator kind
of each worker's node (Ray's ``accelerator_type:<KIND>`` node resource) seeds the estimates when the cluster mixes
kinds (:func:`kind_seeds`, ``worker_speeds.seed_speeds``: by the kinds' datasheet bf16 dense TFLOP/s), so a mixed
cluster is planned for from the first step. Megatron's straggler detector and NVIDIA's resiliency extension score
each rank against the others the same way (``nvidia_resiliency_ext.straggler``, "relative performance score").

Threads: the run loop's thread observes; the drain watch's thread may ask :meth:`planning_topology` at the same time
(``StepPlans.without``): the estimates are read and changed under one lock.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence

import ray

from flexorch.solver.profiles import Profile
from flexorch.solver.topology import Topology
from flexorch.solver.worker_speeds import SpeedChange, WorkerSpeeds, seed_speeds

__all__ = ["ACCELERATOR", "SpeedWatch", "accelerator_kinds", "kind_seeds"]

ACCELERATOR = "accelerator_type:"
"""The prefix of the Ray node resource that names the node's accelerator kind (``accelerator_type:A100``)."""


HISTORY = 64
"""The most recent estimates kept per worker (:meth:`SpeedWatch.slow_workers` looks back at most this far)."""


def accelerator_kinds(node_of: Mapping[int, str | None], ray_nodes: Sequence[dict]) -> dict[int, str | None]:
    """Each worker's accelerator kind: ``node_of`` (worker id -> Ray node id) looked up in ``ray_nodes``
    (``ray.nodes()``: ``NodeID`` and ``Resources`` each); None where its node names none (a CPU node) or is not
    listed."""
    kind_of: dict[str, str | None] = {}
    for node in ray_nodes:
        kinds = sorted(k[len(ACCELERATOR) :] for k in node.get("Resources") or {} if k.startswith(ACCELERATOR))
        kind_of[node.get("NodeID")] = kinds[0] if kinds else None
    return {w: kind_of.get(n) for w, n in node_of.items()}


def kind_seeds(node_of: Mapping[int, str | None], ray_nodes: Sequence[dict]) -> dict[int, float]:
    """The starting speed of each worker when the workers' nodes mix accelerator kinds (``seed_speeds`` of
    :func:`accelerator_kinds`); {} when they are all of one kind, or none is known."""
    kinds = accelerator_kinds(node_of, ray_nodes)
    if len({k for k in kinds.values() if k is not None}) < 2:
        return {}
    return seed_speeds(kinds)


def _measured(record: dict) -> bool:
    """A record the estimates learn from: a trained SP step (a pipelined or skipped one has no SP groups)."""
    return record.get("source") == "train" and not record.get("skipped") and record.get("plan") is not None


class SpeedWatch:
    """The speeds of a run's workers (``publish``: the driver's events; ``metrics``: the run's
    ``records.metrics.RunMetrics`` or None; ``aware``: ``[plan] speeds = "aware"``; ``seeds``: worker id -> a
    starting speed). ``window`` and ``skip_first`` are ``WorkerSpeeds``'s."""

    def __init__(
        self,
        publish: Callable[[dict], None],
        *,
        aware: bool = True,
        metrics=None,
        seeds: dict[int, float] | None = None,
        window: int = 3,
        skip_first: int = 1,
    ):
        self.aware = aware
        self._publish, self._metrics = publish, metrics
        self._speeds = WorkerSpeeds(window=window, skip_first=skip_first, seeds=seeds)
        self._lock = threading.Lock()
        self._world: tuple[int, ...] | None = None  # the worker ids of the last record observed, in rank order
        self._history: dict[int, list[float]] = {}  # worker -> its estimate after each measured step (latest last)

    @classmethod
    def for_run(cls, cfg, workers, publish: Callable[[dict], None], metrics=None) -> SpeedWatch:
        """The watch of a run of ``cfg`` on ``workers`` (a ``control.group.WorkerGroup``): seeded from the
        workers' accelerator kinds with GPU workers (CPU workers: no seeds)."""
        seeds = kind_seeds(workers.nodes_of(), ray.nodes()) if cfg.use_gpu else {}
        return cls(publish, aware=cfg.plan.speeds == "aware", metrics=metrics, seeds=seeds)

    # ------------------------------------------------------------------ the driver's calls
    def observe(
        self,
        record: dict,
        plan_profile: Profile,
        worker_ids: Sequence[int],
        nodes: Sequence[str | None] | None = None,
        pids: Mapping[int, int] | None = None,
    ) -> list[SpeedChange]:
        """Learn from a trained step's ``record`` (before it is written), its plan priced by ``plan_profile``, run
        by ``worker_ids`` (rank order) on ``nodes`` (rank order); ``pids``: worker id -> process id, where known.
        Each rank entry gets ``speed``, ``node`` and ``pid``; each change is published and returned; the metric
        is set."""
        world = tuple(int(w) for w in worker_ids)
        nodes = list(nodes) if nodes is not None else [None] * len(world)
        pids = [(pids or {}).get(w) for w in world]
        with self._lock:
            self._follow(world, bool(record.get("recoveries")))
            changes = self._speeds.observe(record, plan_profile, world, nodes) if _measured(record) else []
            speeds = [round(float(self._speeds.estimate(w)), 3) for w in world]
            if _measured(record):
                for w, speed in zip(world, speeds, strict=True):
                    self._history[w] = [*self._history.get(w, [])[-HISTORY + 1 :], speed]
        for entry, speed, node, pid in zip(record.get("ranks") or (), speeds, nodes, pids, strict=False):
            if entry is not None:  # None: a rank lost after the update stood
                entry.update(speed=speed, node=node, pid=None if pid is None else int(pid))
        for change in changes:
            self._publish({"event": "speed", "message": change.message(), **dataclasses.asdict(change)})
        if self._metrics is not None:
            self._metrics.on_speeds(world, nodes, speeds)
        return changes

    def _follow(self, world: tuple[int, ...], changed: bool) -> None:
        """A record of another world than the last (or with a membership change made for it): a new world, the
        workers gone forgotten. Under the lock."""
        if self._world is not None and (changed or world != self._world):
            for w in set(self._world) - set(world):
                self._speeds.forget(w)
                self._history.pop(w, None)
            self._speeds.new_world()
        self._world = world

    def new_world(self) -> None:
        """The membership changed: the next steps of the new world are left out of the estimates."""
        with self._lock:
            self._speeds.new_world()

    def forget(self, worker: int) -> None:
        """``worker`` left the run: its estimate goes."""
        with self._lock:
            self._speeds.forget(worker)
            self._history.pop(worker, None)

    # ------------------------------------------------------------------ what the planner and the retire ask
    def planning_speeds(self, worker_ids: Sequence[int]) -> tuple[float, ...]:
        """Each rank's speed as the planner is given it (``WorkerSpeeds.planning_speeds``: snapped)."""
        with self._lock:
            return tuple(self._speeds.planning_speeds(list(worker_ids)))

    def planning_topology(self, base: Topology | None, n: int, worker_ids: Sequence[int]) -> Topology | None:
        """The topology to plan a world of ``n`` workers with: ``base`` (its nodes; None: one node) with the ranks'
        planning speeds when speeds are planned for (``aware``) and some rank is off 1.0; ``base`` otherwise, also
        when ``worker_ids`` (the world's members, rank order) are not the ``n`` ranks (joiners not admitted yet)."""
        if not self.aware or len(worker_ids) != n:
            return base
        speeds = self.planning_speeds(worker_ids)
        if all(v == 1.0 for v in speeds):
            return base
        return (base or Topology.single(n)).with_speeds(speeds)

    def estimate(self, worker: int) -> float:
        """``worker``'s speed relative to the others (1.0: the median worker's)."""
        with self._lock:
            return float(self._speeds.estimate(worker))

    def slow_workers(self, threshold: float, for_steps: int) -> list[int]:
        """Members of the last world whose speed stayed below ``threshold`` for their last ``for_steps`` observed
        steps (the elastic retire, ``[elastic] retire_below_speed``), slowest first: slow for that many observed steps
        (``WorkerSpeeds.slow_steps``) and their estimate below ``threshold`` after each of them."""
        with self._lock:
            slow = []
            for w in self._world or ():
                after = self._history.get(w, [])[-for_steps:]
                if self._speeds.slow_steps(w) >= for_steps and len(after) == for_steps and max(after) < threshold:
                    slow.append(w)
            return sorted(slow, key=lambda w: (self._speeds.estimate(w), w))
