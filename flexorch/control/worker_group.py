"""The driver's handle on its worker actors: one worker actor per device, stable worker ids, one world per epoch.

The driver talks to workers only through this class. Workers are plain actors (``num_cpus=1``, plus
``num_gpus=1`` on GPU) rather than bundles of one fixed placement group, so the set can shrink when a node dies
and grow when one joins. ``membership`` maps stable worker ids to ranks (rank = position in ascending id order).
Every :meth:`form_world` starts a new membership epoch with a fresh rendezvous TCPStore hosted here; dropping the
old store closes its connections, so workers stuck in an abandoned rendezvous fail at once.

The group is built from two components, each given what it needs and owning its own state: a
:class:`~flexorch.control.settle.Settler` waits for a call on every worker and sorts what happened into a
:class:`~flexorch.control.failures.Failure` value; a :class:`~flexorch.control.state_moves.StateMoves` moves the
model state between members and keeps which parts each holds. This file holds the world (starting, admitting and
removing members, forming a world) and hands the rest of the :class:`~flexorch.control.group.WorkerGroup`
interface to them.

Starting workers on a slow machine (``control.worker_start``): a worker is waited for while it makes progress, not for
a fixed time; the group gives up only when nothing changed for ``placement_timeout_s``, when a start failed, or at
once when the cluster has fewer slots than needed. Setup waits publish ``{"event": "progress", "message": ...}`` events.
"""

from __future__ import annotations

import dataclasses
import time

import ray
import torch.distributed as dist

from flexorch.config.model import ModelConfig
from flexorch.control.drains import NodeDrain, draining_nodes, free_slots_on_draining
from flexorch.control.failures import Failure, WorkerGroupError
from flexorch.control.group import WorkerGroup
from flexorch.control.heartbeats import Heartbeats
from flexorch.control.membership import Membership
from flexorch.control.settle import PROGRESS_EVERY_S, Settler
from flexorch.control.state_moves import StateMoves
from flexorch.control.worker_start import WorkerStarter
from flexorch.work.placement import PartsLostError, model_parts
from flexorch.workers.actor import worker_actor

STOP_BEATS_S = 2.0  # at shutdown: the longest wait for the workers' heartbeat threads to stop
RETIRE_S = 1.0  # a planned leave: the longest wait for the leaving workers to freeze their objects before the kill

__all__ = ["RayWorkerGroup"]


def _no_publish(event: dict) -> None:
    """The default ``publish``: progress goes nowhere."""


class RayWorkerGroup(WorkerGroup):
    """Worker actors keyed by stable worker id; ``actors`` lists the members in rank order."""

    worker_class = None
    """The actor class :meth:`start_workers` starts; None: the one for the run's sharding mode
    (``workers.actor.worker_actor``). A seam: tests start slow or failing stand-ins."""

    def __init__(
        self,
        num_workers: int,
        *,
        model_cfg: dict,
        optim_cfg: dict,
        seed: int,
        use_gpu: bool = False,
        threads: int = 1,
        collective_timeout_s: float = 120.0,
        placement_timeout_s: float = 60.0,
        heartbeat_timeout_s: float = 10.0,
        min_workers: int | None = None,
        sharding: dict | None = None,
        publish=None,
        by_node: bool = True,
    ):
        self.timeout_s = collective_timeout_s
        self.form_phases_ms: dict | None = None
        """Where the last :meth:`form_world` went: the slowest member's ms to leave, meet and build its state."""
        self._starts = WorkerStarter(use_gpu=use_gpu, placement_timeout_s=placement_timeout_s)
        self._publish = publish or _no_publish
        self.use_gpu = use_gpu
        self._args = (model_cfg, optim_cfg, seed, threads, sharding, use_gpu)  # Worker.__init__ after worker_id
        parts = model_parts(int(model_cfg.get("num_layers", ModelConfig().num_layers)))
        self._actor_class = worker_actor(sharding)  # replicated or sharded model state (workers.actor)
        self.sharded = bool(sharding) and sharding.get("mode", "replicate") != "replicate"
        """Model state sharded over the workers (FSDP2): it moves when the world re-forms, never through
        :meth:`sync_state`."""
        self._initialised = False  # the first world fills the initial parameters
        self.restored: dict | None = None
        """Sharded: what the last :meth:`form_world` restored (``{"version", "newest"}``, per worker.join_world)."""
        self._lost_since_state: list[int] = []
        """Members removed since the last world restored the sharded state: those a lost shard was held by."""
        self.membership = Membership(by_node=by_node)
        """Ranks contiguous per node unless ``by_node`` is False (``[plan] topology = "blind"``)."""
        self._actors: dict[int, ray.actor.ActorHandle] = {}
        self._nodes: dict[int, str] = {}  # member -> the Ray node id it runs on (from its start's info)
        self._node_ips: dict[str, str] = {}  # Ray node id -> its address (from the starts' info)
        self._pids: dict[int, int] = {}  # worker id -> its process id (from its start's info)
        self.host = ray.util.get_node_ip_address()
        self.driver_node = ray.get_runtime_context().get_node_id()
        """The Ray node this group (and the driver holding it) runs on: a drain of it is announced as such."""
        self.store: dist.TCPStore | None = None
        self._worlds = 0
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._settler = Settler(
            self._actors,
            Heartbeats(self.host, heartbeat_timeout_s),
            self.membership,
            timeout_s=collective_timeout_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            close_rendezvous=self._close_rendezvous,
            publish=self._publish,
        )
        self._moves = StateMoves(self._actors, self.membership, self._settler, sharded=self.sharded, parts=parts)
        self._start_first(num_workers, num_workers if min_workers is None else min_workers)

    def _start_first(self, num_workers: int, need: int) -> None:
        """Start the run's workers: no more than the cluster holds (a job on a smaller cluster starts with what fits;
        the elastic policy grows it up to max_workers when nodes join), at least ``need``; slots other jobs hold
        are waited for while anything progresses."""
        self._check_capacity(need)
        self.start_workers(max(need, min(num_workers, self._starts.total_slots())))
        self._await_start(need)

    def _await_start(self, need: int) -> None:
        """Wait for the starting workers while they progress (see the module doc); at least ``need`` must start."""
        t0 = time.monotonic()
        started = len(self.joining)
        last, last_t = None, t0
        msg = f"starting workers: {self._starts.summary(self.size, started, 0.0)}"
        self._publish({"event": "progress", "message": msg})
        while self.joining and self.size + len(self.joining) >= need:
            self.admit(self.ready_joiners(wait_s=1.0))
            now = time.monotonic()
            changed = (self.size, len(self.joining), len(self.start_failures))
            if self.joining and (changed != last or now - last_t >= PROGRESS_EVERY_S):
                msg = f"starting workers: {self._starts.summary(self.size, started, now - t0)}"
                self._publish({"event": "progress", "message": msg})
                last, last_t = changed, now
        if self.size < need:
            msg = self._starts.failure_message(self.size, started, need, time.monotonic() - t0)
            self.shutdown()
            raise WorkerGroupError(msg)
        msg = f"starting workers: {self.size} of {started} ready after {time.monotonic() - t0:.0f} s"
        self._publish({"event": "progress", "message": msg})

    @classmethod
    def from_config(cls, cfg, publish=None) -> RayWorkerGroup:
        """The workers a ``TrainConfig`` asks for (its model, optimizer, seed, device kind and timeouts);
        ``publish`` gets progress events while they start and while setup calls on them wait."""
        return cls(
            cfg.workers,
            model_cfg=cfg.model.to_dict(),
            optim_cfg=dataclasses.asdict(cfg.optim),
            seed=cfg.seed,
            use_gpu=cfg.use_gpu,
            threads=cfg.worker_threads,
            collective_timeout_s=cfg.elastic.collective_timeout_s,
            heartbeat_timeout_s=cfg.elastic.heartbeat_timeout_s,
            min_workers=cfg.min_workers,
            sharding={
                "mode": cfg.sharding_mode,
                "shard_size": cfg.sharding.shard_size,
                "precision": cfg.precision,
                "recompute": cfg.recompute,
                "stages": cfg.pipeline.stages,
                "gather": cfg.sharding.gather,
            },
            publish=publish,
            by_node=cfg.plan.topology != "blind",
        )

    # ---------------------------------------------------------------- membership
    @property
    def size(self) -> int:
        return self.membership.size

    @property
    def worker_ids(self) -> tuple[int, ...]:
        return self.membership.worker_ids

    @property
    def actors(self) -> list:
        """Member actors in rank order."""
        return [self._actors[w] for w in self.membership.worker_ids]

    def actor(self, worker_id: int):
        return self._actors[worker_id]

    def _check_capacity(self, need: int) -> None:
        key = "GPU" if self.use_gpu else "CPU"
        total = self._starts.total_slots()
        if total < need:
            raise WorkerGroupError(
                f"the Ray cluster has {total:g} {key} slots, the run needs at least {need} workers of 1 {key} each; "
                "lower `workers`/`min_workers`, or add nodes or slots (e.g. `ray start --num-cpus N`)"
            )

    @property
    def joining(self) -> dict[int, tuple]:
        """Workers started and not yet members: worker id -> (actor, ready ref, start time)."""
        return self._starts.joining

    @property
    def start_failures(self) -> dict[int, tuple[str, str]]:
        """Workers given up while starting: worker id -> (kind, why) (``WorkerStarter.start_failures``)."""
        return self._starts.start_failures

    def free_slots(self) -> int:
        """Unclaimed device slots in the cluster now (a joined node shows up here), less those on draining nodes
        (Ray places nothing new there)."""
        key = "GPU" if self.use_gpu else "CPU"
        return max(0, self._starts.free_slots() - int(free_slots_on_draining(key)))

    def nodes_of(self) -> dict[int, str]:
        """{member worker id: the Ray node id it runs on}."""
        return {w: self._nodes[w] for w in list(self.membership.worker_ids) if w in self._nodes}

    def draining_nodes(self) -> list[NodeDrain]:
        """Nodes of the cluster being drained (``control.drains``)."""
        return draining_nodes()

    def leaving_notices(self) -> dict[int, float]:
        """Members whose process got SIGTERM: worker id -> when (unix seconds), from their heartbeats."""
        beats = self.heartbeats
        return beats.leaving(list(self.membership.worker_ids)) if beats is not None else {}

    def start_workers(self, count: int) -> list[int]:
        """Start ``count`` new worker actors with fresh ids; they join at :meth:`admit` once ready."""
        ids = self.membership.new_ids(count)
        self._starts.start(self.worker_class or self._actor_class, ids, self._args)
        return ids

    def ready_joiners(self, wait_s: float = 0.0) -> list[int]:
        """Joining workers whose actor is up. Drops joiners that failed to start (their error goes to
        :attr:`start_failures`) and, once no joiner progressed for ``placement_timeout_s``, those still starting."""
        return self._starts.ready(wait_s)

    def admit(self, worker_ids) -> None:
        """Make ready joiners members (the next :meth:`form_world` gives them ranks)."""
        for wid in worker_ids:
            ready = self.joining[wid][1]
            self._actors[wid] = self._starts.take(wid)
            info = ray.get(ready)  # its start's ``info``, already answered
            self._nodes[wid] = info.get("node_id")
            self._pids[wid] = info.get("pid")
            if info.get("node_ip"):
                self._node_ips[info["node_id"]] = info["node_ip"]
            self._moves.joined(wid)
            if self.heartbeat_timeout_s:
                self._actors[wid].start_heartbeat.remote(self.host, self.heartbeats.port)
        self.membership.add(worker_ids, self._nodes)

    def rank_nodes(self) -> list[str | None]:
        """Each rank's node in rank order, by its address (its Ray node id where the address is not known)."""
        out = []
        for w in self.membership.worker_ids:
            node = self._nodes.get(w)
            out.append(self._node_ips.get(node, node) if node is not None else None)
        return out

    def pids_of(self) -> dict[int, int]:
        """{member worker id: its process id} (from its start's ``Worker.info``)."""
        return {w: self._pids[w] for w in list(self.membership.worker_ids) if self._pids.get(w) is not None}

    def remove(self, worker_ids, retiring: bool = False) -> None:
        """Drop members (dead, hung or unwanted); their actors are killed if still running. ``retiring``: they are
        alive and idle (they left on notice): each freezes its objects first (``Worker.retire``, a bounded wait), so
        dying costs it no garbage collection on CPU the members that stay may share."""
        self._lost_since_state += worker_ids
        if retiring:
            frozen = [self._actors[w].retire.remote() for w in worker_ids]
            ray.wait(frozen, num_returns=len(frozen), timeout=RETIRE_S)
        for wid in worker_ids:
            ray.kill(self._actors.pop(wid), no_restart=True)
            self._moves.left(wid)
            self._nodes.pop(wid, None)
            self._pids.pop(wid, None)
        self.membership.remove(worker_ids)

    def form_world(self) -> float:
        """Every member joins a fresh world (the next membership epoch); returns the seconds it took. Sharded
        state is re-sharded for the new world as it forms; when the members no longer hold every shard of it
        (``fsdp``: a lost worker's shard had no copy) this raises :class:`~flexorch.work.placement.PartsLostError`
        with the world formed, and the driver loads its last checkpoint. :attr:`form_phases_ms`: the slowest
        member's ms per phase (leave, rendezvous, state)."""
        epoch = self.membership.next_epoch()
        t0 = time.perf_counter()
        self.store = None  # close the last epoch's rendezvous: anyone still waiting on it fails now
        self.store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False)
        ids = self.worker_ids
        initial = self.sharded and not self._initialised
        self._worlds += 1
        if self._worlds == 1:
            self._publish(
                {"event": "progress", "message": f"forming the first world of {len(ids)} worker{'s' * (len(ids) != 1)}"}
            )
        refs = {
            w: self._actors[w].join_world.remote(
                self.host, self.store.port, r, len(ids), epoch, self.timeout_s, initial
            )
            for r, w in enumerate(ids)
        }
        got = self.call_all(refs, "form a torch.distributed world", self.timeout_s + 30.0)
        phases = [g["phases_ms"] for g in got.values() if isinstance(g, dict) and "phases_ms" in g]
        self.form_phases_ms = max(phases, key=lambda p: sum(p.values())) if phases else None  # the slowest member
        self._initialised = True
        if self.sharded:
            self.restored = got[ids[0]]
            if self.restored["version"] is None:
                raise PartsLostError(["model-state shards"], self._lost_since_state)
        self._lost_since_state = []
        return time.perf_counter() - t0

    def _close_rendezvous(self) -> None:
        """Drop this epoch's rendezvous store: workers still waiting in it fail at once (``Settler``)."""
        self.store = None

    # ---------------------------------------------------------------- calls
    @property
    def heartbeats(self) -> Heartbeats | None:
        """The workers' heartbeat watch (``control.heartbeats``; None once shut down)."""
        return self._settler.heartbeats

    def settle(self, refs: dict, timeout_s: float, what: str | None = None) -> tuple[dict, Failure | None]:
        """:meth:`Settler.settle <flexorch.control.settle.Settler.settle>`."""
        return self._settler.settle(refs, timeout_s, what)

    def call_all(self, refs: dict, what: str, timeout_s: float) -> dict:
        """:meth:`settle`, raising :class:`~flexorch.control.failures.MembershipFailure` on any failure."""
        return self._settler.call_all(refs, what, timeout_s)

    def detection(self, lost) -> dict | None:
        return self._settler.detection(lost)

    def run_step(self, work, block_specs: list[dict]) -> dict:
        """Start every rank's step; returns {worker id: outcome ref} (the caller settles them). The step's
        ``(work, block specs)`` pairs go into the object store once, and each rank is given the reference and its
        index: the members of a group share its documents, which pickling each rank's arguments apart would
        serialize once per member."""
        pairs = list(zip(work, block_specs, strict=True))
        step = ray.put(pairs)
        return {
            w: self._actors[w].run_step.remote(step, i) for i, w in zip(range(len(pairs)), self.worker_ids, strict=True)
        }

    def call(self, method: str, *args) -> list:
        """Call a worker method on every rank and wait; results in rank order (e.g. 'parameters_digest')."""
        calls = {w: getattr(self._actors[w], method) for w in self.worker_ids}  # optional: not a probe, by name
        refs = {w: c.remote(*args) for w, c in calls.items()}
        out = self.call_all(refs, method, self.timeout_s + 30)
        return [out[w] for w in self.worker_ids]

    def shutdown(self) -> None:
        """Stop the workers' heartbeats (a bounded wait: a hung worker does not answer), kill the workers, then
        drop the stores: a beat into a store already closed prints a C++ stack trace on the worker."""
        actors = list(self._actors.values()) + [j[0] for j in self.joining.values()]
        stops = [a.stop_heartbeat.remote() for a in actors]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=STOP_BEATS_S)
        for actor in actors:
            ray.kill(actor, no_restart=True)
        self._actors.clear()
        self.joining.clear()
        self.store = None
        self._settler.heartbeats = None

    # ---------------------------------------------------------------- model state (control.state_moves)
    def hand_off(self, leaving) -> dict:
        return self._moves.hand_off(leaving)

    def sync_state(self, source: int, targets) -> None:
        self._moves.sync_state(source, targets)

    def missing_parts(self) -> list[str]:
        return self._moves.missing_parts()

    def place_params(self, needed_by_rank) -> dict:
        return self._moves.place_params(needed_by_rank)

    def get_state(self, rank: int = 0) -> dict:
        return self._moves.get_state(rank)

    def set_state(self, state: dict) -> None:
        self._moves.set_state(state)

    def save_sharded(self, directory: str) -> None:
        self._moves.save_sharded(directory)

    def stage_sharded(self, directory: str):
        return self._moves.stage_sharded(directory)

    def write_whole(self, directory: str, background: bool):
        return self._moves.write_whole(directory, background)

    def state_versions(self, timeout_s: float) -> dict[int, int]:
        return self._moves.state_versions(timeout_s)
