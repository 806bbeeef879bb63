"""The driver's handle on its worker actors: one WorkerActor per device, stable worker ids, one world per epoch.

The driver talks to workers only through this class. Workers are plain actors (``num_cpus=1``, plus
``num_gpus=1`` on GPU) rather than bundles of one fixed placement group, so the set can shrink when a node dies
and grow when one joins. ``membership`` maps stable worker ids to ranks (rank = position in ascending id order).
Every :meth:`form_world` starts a new membership epoch with a fresh rendezvous TCPStore hosted here; dropping the
old store closes its connections, so workers stuck in an abandoned rendezvous fail at once.

:meth:`settle` waits for a call on every worker and sorts what happened into a :class:`~flexorch.control.membership.
Failure` (lost, peer errors, deterministic errors, completed) instead of failing on the first error: the elastic
driver needs to know who survived and in which state.

Starting workers on a slow machine (``control.worker_start``): a worker is waited for while it makes progress, not for
a fixed time; the group gives up only when nothing changed for ``placement_timeout_s``, when a start failed, or at
once when the cluster has fewer slots than needed. Setup waits publish ``{"event": "progress", "message": ...}`` events.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

import ray
import torch.distributed as dist

from flexorch.config.model import ModelConfig
from flexorch.control.drains import NodeDrain, draining_nodes, free_slots_on_draining
from flexorch.control.heartbeats import Heartbeats
from flexorch.control.membership import Failure, Membership
from flexorch.control.worker_start import WorkerStarter
from flexorch.tasks.placement import ALL, PartsLostError, handoff_needs, missing_parts, model_parts, transfers
from flexorch.workers.actor import PeerLostError, StepOutOfMemoryError, WorkerActor

BEAT_CHECK_S = 0.5  # while waiting on workers: how often their heartbeats are looked at
BROKEN_WORLD_SILENCE_S = 3.0
"""Once a world broke (a member lost, its peers failing out), a member still unanswered whose heartbeat has not moved
for this long is counted lost too, without waiting out ``heartbeat_timeout_s``: a live worker beats through any
step (the thread beats beside it), so after a failure three missed beats mean its process or node is gone (a node
killed at once: its raylet and workers, whose deaths Ray reports only after its health check gives up). Not after
a worker's own error: then nothing is lost yet, and the peers hold the state an emergency checkpoint is written from,
so a loaded machine's missed beats must not cost a shard (``ERROR_GRACE_S`` and ``heartbeat_timeout_s`` apply)."""
ERROR_GRACE_S = 15.0
"""After a worker raises (a bug: the run stops), how long its peers get to leave the broken world before they are
killed: they hold the state the emergency checkpoint is written from (``control.emergency``), and on a loaded
2-core machine a peer can take several seconds to fail out of a closed rendezvous (killed sooner, its shard is lost
and no emergency checkpoint can be written). Well below ``collective_timeout_s``: a bug still stops the run in
seconds."""
STOP_BEATS_S = 2.0  # at shutdown: the longest wait for the workers' heartbeat threads to stop
PROGRESS_EVERY_S = 10.0  # while setup waits: a progress event at least this often (and whenever something changed)

__all__ = ["RayWorkerGroup", "WorkerGroupError", "MembershipFailure"]


class WorkerGroupError(RuntimeError):
    """Workers could not be placed, or failed in a way the run cannot recover from."""


class MembershipFailure(WorkerGroupError):
    """A call on the workers failed; ``failure`` says who was lost and in which state the others are."""

    def __init__(self, what: str, failure: Failure, timeout_s: float | None = None):
        self.failure = failure
        parts = []
        if failure.lost - failure.timed_out:
            parts.append(f"lost workers {sorted(failure.lost - failure.timed_out)}")
        if failure.timed_out:
            limit = f" within its limit of {timeout_s:.3g} s" if timeout_s is not None else " in time"
            parts.append(f"workers {sorted(failure.timed_out)} did not finish{limit} and were killed")
        if failure.peer_errors:
            parts.append(f"workers {sorted(failure.peer_errors)} left the broken world")
        parts += [f"worker {w}: {m}" for w, m in failure.errors]
        super().__init__(f"could not {what}: {'; '.join(parts)}")


def _where(err: BaseException) -> str:
    """`` (at FILE:LINE in FUNC)``: the innermost frame of a worker's own error, from the traceback its worker
    attached as a note (``Worker._guarded``), so a one-line reason still says where it was raised."""
    for note in reversed(getattr(err, "__notes__", None) or ()):
        frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', note)
        if frames:
            path, line, func = frames[-1]
            return f" (at {Path(path).name}:{line} in {func})"
    return ""


def _no_publish(event: dict) -> None:
    """The default ``publish``: progress goes nowhere."""


class RayWorkerGroup:
    """Worker actors keyed by stable worker id; ``actors`` lists the members in rank order."""

    worker_class = WorkerActor
    """The actor class :meth:`start_workers` starts (a seam: tests start slow or failing stand-ins)."""

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
    ):
        self.timeout_s = collective_timeout_s
        self._starts = WorkerStarter(use_gpu=use_gpu, placement_timeout_s=placement_timeout_s)
        self._publish = publish or _no_publish
        self.use_gpu = use_gpu
        self._args = (model_cfg, optim_cfg, seed, threads, sharding, use_gpu)  # Worker.__init__ after worker_id
        self.sharded = bool(sharding) and sharding.get("mode", "replicate") != "replicate"
        """Model state sharded over the workers (FSDP2): it moves when the world re-forms, never through
        :meth:`sync_state`."""
        self._initialised = False  # the first world fills the initial parameters
        self.restored: dict | None = None
        """Sharded: what the last :meth:`form_world` restored (``{"version", "newest"}``, per worker.join_world)."""
        self.parts = model_parts(int(model_cfg.get("num_layers", ModelConfig().num_layers)))
        self.held: dict[int, frozenset[str] | None] = {}
        """Model parts each member holds (``flexorch.tasks.placement``; None: the whole model)."""
        self.membership = Membership()
        self._actors: dict[int, ray.actor.ActorHandle] = {}
        self._nodes: dict[int, str] = {}  # member -> the Ray node id it runs on (from its start's info)
        self.host = ray.util.get_node_ip_address()
        self.driver_node = ray.get_runtime_context().get_node_id()
        """The Ray node this group (and the driver holding it) runs on: a drain of it is announced as such."""
        self.store: dist.TCPStore | None = None
        self._worlds = 0
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.heartbeats = Heartbeats(self.host, heartbeat_timeout_s)
        self.silent: dict[int, float] = {}
        """Workers declared hung by their heartbeat during the last :meth:`settle`: worker id -> seconds silent."""
        need = num_workers if min_workers is None else min_workers
        self._check_capacity(need)
        # no more than the cluster holds (a job on a smaller cluster starts with what fits; the elastic policy grows
        # it up to max_workers when nodes join); slots other jobs hold are waited for while anything progresses
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

    def hand_off(self, leaving) -> dict:
        """Before members ``leaving`` go (their node is being drained), give the members that stay what only the
        leaving hold: with sharded state each leaving worker's shards (round robin over the stayers, who bring them
        to the next world's re-shard); with stage-local parameters the parts no stayer holds (``place_params``);
        replicas hold everything already. Returns ``{"handoff_bytes", "handoff_ms"}``."""
        t0 = time.perf_counter()
        leaving = sorted(leaving)
        stay = [w for w in self.worker_ids if w not in leaving]
        nbytes = 0
        if self.sharded:  # each leaver returns (size, holding): the driver waits on the sizes, never the shards
            pairs = {w: self._actors[w].hand_off.remote() for w in leaving}
            self.call_all({w: p[0] for w, p in pairs.items()}, "hand off the leaving workers' shards", self.timeout_s)
            handed: dict[int, list] = {}
            for i, w in enumerate(leaving):
                handed.setdefault(stay[i % len(stay)], []).append(pairs[w][1])
            refs = {dst: self._actors[dst].take_handoff.remote(rs) for dst, rs in handed.items()}
            got = self.call_all(refs, "take the leaving workers' shards", self.timeout_s)
            nbytes = int(sum(got.values()))
        else:
            needed = handoff_needs(self.held, self.worker_ids, leaving, self.parts)
            if needed is not None:
                nbytes = int(self.place_params(needed)["moved_bytes"])
        return {"handoff_bytes": nbytes, "handoff_ms": (time.perf_counter() - t0) * 1e3}

    def start_workers(self, count: int) -> list[int]:
        """Start ``count`` new worker actors with fresh ids; they join at :meth:`admit` once ready."""
        ids = self.membership.new_ids(count)
        self._starts.start(self.worker_class, ids, self._args)
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
            self._nodes[wid] = ray.get(ready).get("node_id")  # its start's ``info``, already answered
            self.held[wid] = ALL  # a new worker builds the whole model (its state comes from sync_state)
            start = getattr(self._actors[wid], "start_heartbeat", None)  # a stand-in worker class may not beat
            if self.heartbeat_timeout_s and start is not None:
                start.remote(self.host, self.heartbeats.port)
        self.membership.add(worker_ids)

    def remove(self, worker_ids) -> None:
        """Drop members (dead, hung or unwanted); their actors are killed if still running."""
        self._lost_since_state = [*getattr(self, "_lost_since_state", []), *worker_ids]
        for wid in worker_ids:
            ray.kill(self._actors.pop(wid), no_restart=True)
            self.held.pop(wid, None)
            self._nodes.pop(wid, None)
        self.membership.remove(worker_ids)

    def form_world(self) -> float:
        """Every member joins a fresh world (the next membership epoch); returns the seconds it took. Sharded
        state is re-sharded for the new world as it forms; when the members no longer hold every shard of it
        (``fsdp``: a lost worker's shard had no copy) this raises :class:`~flexorch.tasks.placement.PartsLostError`
        with the world formed, and the driver loads its last checkpoint."""
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
        self._initialised = True
        if self.sharded:
            self.restored = got[ids[0]]
            if self.restored["version"] is None:
                raise PartsLostError(["model-state shards"], self._lost_since_state)
        self._lost_since_state = []
        return time.perf_counter() - t0

    # ---------------------------------------------------------------- calls
    def run_step(self, tasks, block_refs: list[dict]) -> dict:
        """Start every rank's step; returns {worker id: outcome ref} (the caller settles them)."""
        return {
            w: self._actors[w].run_step.remote(t, refs)
            for w, t, refs in zip(self.worker_ids, tasks, block_refs, strict=True)
        }

    def settle(self, refs: dict, timeout_s: float, what: str | None = None) -> tuple[dict, Failure | None]:
        """Wait for every worker's call; returns ({worker id: result} of those that finished, failure or None).

        After the first failure the rendezvous store is closed (a worker waiting in a rendezvous or ``new_group``
        fails at once) and the others get ``collective_timeout_s`` plus a grace to settle (survivors whose
        collective broke fail fast; one blocked on a silent peer fails at its collective timeout); a worker that
        has not answered by then is hung: it is killed and counted as lost. A worker's own error (a bug, bad
        input) is final, so then the others get only ``ERROR_GRACE_S``; those still unanswered then are killed unless
        their heartbeat shows them alive (in a bounded wait: they are left running and reported nowhere, since the
        run stops on the error and its emergency checkpoint may need their state). With ``what``, a wait
        longer than ``PROGRESS_EVERY_S`` publishes progress (who answered, who is still working).
        """
        pending = {ref: wid for wid, ref in refs.items()}
        results, lost, peer, errors, oom = {}, set(), set(), [], set()
        self.silent, self.failed_at = {}, None
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        tick = t0 + PROGRESS_EVERY_S
        while pending:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                break
            if what is not None and now >= tick:
                tick = now + PROGRESS_EVERY_S
                msg = (
                    f"waiting for workers ({what}): {len(refs) - len(pending)} of {len(refs)} done after "
                    f"{now - t0:.0f} s (still working: workers {sorted(pending.values())})"
                )
                self._publish({"event": "progress", "message": msg})
            wait_s = left if what is None else max(0.0, min(left, tick - now))
            if self.heartbeat_timeout_s:
                wait_s = min(wait_s, BEAT_CHECK_S)
                limit = self.heartbeat_timeout_s
                if self.failed_at is not None and not errors:  # a member was lost: silence means gone too
                    limit = min(limit, BROKEN_WORLD_SILENCE_S)
                hung = self.heartbeats.silent(set(pending.values()), limit)
                if hung:  # killed now: its sockets close, so peers blocked on it fail at once
                    for ref in [r for r, w in pending.items() if w in hung]:
                        ray.kill(self._actors[pending.pop(ref)], no_restart=True)
                    lost |= set(hung)
                    self.silent.update(hung)
                    if self.failed_at is None:
                        self.failed_at = time.monotonic()
                        self._abort_pending(pending.values())
                    self.store = None
                    if not errors:
                        deadline = min(deadline, time.monotonic() + self.timeout_s + 5.0)
                    continue
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
            for ref in ready:
                wid = pending.pop(ref)
                try:
                    results[wid] = ray.get(ref)
                    continue
                except ray.exceptions.RayActorError:
                    lost.add(wid)
                except ray.exceptions.RayTaskError as e:
                    cause = e.cause if e.cause is not None else e
                    if isinstance(cause, PeerLostError) or isinstance(e, PeerLostError):
                        peer.add(wid)
                    elif isinstance(cause, StepOutOfMemoryError):  # not final: re-planned with less memory
                        oom.add(wid)
                    else:
                        first = str(cause).splitlines()[0][:500]
                        errors.append((wid, f"{type(cause).__name__}: {first}{_where(cause)}"))
                if self.failed_at is None:  # the world is broken: end every collective still waiting in it now
                    self.failed_at = time.monotonic()
                    self._abort_pending(pending.values())
                if self.store is not None:  # the world is broken: workers blocked in its rendezvous fail now
                    self.store = None
                # a worker's own error ends the run (it is not retried), so peers get a short grace only
                grace = ERROR_GRACE_S if errors else self.timeout_s + 5.0
                deadline = min(deadline, time.monotonic() + grace)
        timed_out = set()
        for wid in pending.values():  # hung past the collective timeout
            if errors and self.heartbeats.beating(wid):
                continue  # alive, in a bounded wait: left running, its state may be kept (control.emergency)
            ray.kill(self._actors[wid], no_restart=True)
            lost.add(wid)
            if self.failed_at is None:  # nothing else failed: the call itself ran past its limit
                timed_out.add(wid)
        if not (lost or peer or errors or oom):
            return results, None
        return results, Failure(
            frozenset(lost), frozenset(peer), tuple(errors), frozenset(results), frozenset(oom), frozenset(timed_out)
        )

    def _abort_pending(self, worker_ids) -> None:
        """Tell workers still in a call on a broken world to shut its sockets down (``Worker.abort_world``, on
        their control thread): a collective waiting on a gone or frozen peer fails at once. Not waited for."""
        for w in worker_ids:
            abort = getattr(self._actors.get(w), "abort_world", None)  # a stand-in worker class may lack it
            if abort is not None:  # this epoch's world only: a late abort must not reach the next world
                abort.remote(self.membership.epoch)

    def detection(self, lost) -> dict | None:
        """How the last :meth:`settle`'s failure was found (``Heartbeats.detection``): by, detect_ms, since_ms."""
        return self.heartbeats.detection(lost, self.failed_at, self.silent)

    def call_all(self, refs: dict, what: str, timeout_s: float) -> dict:
        """:meth:`settle`, raising :class:`MembershipFailure` on any failure."""
        results, failure = self.settle(refs, timeout_s, what)
        if failure is not None:
            raise MembershipFailure(what, failure, timeout_s)
        return results

    def sync_state(self, source: int, targets) -> None:
        """Copy model, optimizer, schedule and RNG state from worker ``source`` to ``targets`` (object store): they
        then hold what ``source`` holds (with stage-local parameters, its parts only)."""
        targets = [t for t in targets if t != source]
        if self.sharded:  # sharded state moves as the next world forms (flexorch.workers.reshard)
            return
        if targets:
            ref = self._actors[source].get_state.remote()
            self.call_all(
                {t: self._actors[t].set_state.remote(ref) for t in targets}, "copy the model state", self.timeout_s
            )
            for t in targets:
                self.held[t] = self.held[source]

    def missing_parts(self) -> list[str]:
        """Model parts no member holds (their every holder was lost)."""
        return missing_parts({w: self.held[w] for w in self.worker_ids}, self.parts)

    def place_params(self, needed_by_rank) -> dict:
        """Before a step with stage-local parameters: copy to each member the parts it will need and does not hold
        (``needed_by_rank[r]``: the parts rank r holds during the step), each from a holder, through the object
        store; the step itself drops what a member no longer needs. Returns what moved."""
        t0 = time.perf_counter()
        needed = {w: frozenset(needed_by_rank[r]) for r, w in enumerate(self.worker_ids)}
        moves = transfers({w: self.held[w] for w in self.worker_ids}, needed, self.parts)
        refs = {}
        for dst, srcs in moves.items():
            exported = [self._actors[src].export_parts.remote(list(parts)) for src, parts in srcs.items()]
            refs[dst] = self._actors[dst].import_parts.remote(exported)
        got = self.call_all(refs, "move parameters between stages", self.timeout_s) if refs else {}
        self.held.update(needed)
        return {
            "moved_parts": sum(len(ps) for srcs in moves.values() for ps in srcs.values()),
            "moved_bytes": int(sum(got.values())),
            "move_ms": (time.perf_counter() - t0) * 1e3,
        }

    def get_state(self, rank: int = 0) -> dict:
        """The whole model's state: from one member when it holds everything, else assembled from holders of
        every part (model tensors and optimizer state by part; schedule and RNG from the first)."""
        ids = self.worker_ids
        first = ids[rank]
        if self.held[first] is ALL:
            return self.call_all(
                {first: self._actors[first].get_state.remote()}, "fetch the model state", self.timeout_s
            )[first]
        missing = self.missing_parts()
        if missing:
            raise WorkerGroupError(f"no member holds {missing}: the model state cannot be assembled")
        chosen, covered = [], set()
        for w in [first, *[x for x in ids if x != first]]:  # fewest fetches: take holders in rank order
            if self.held[w] is ALL or not self.held[w] <= covered:
                chosen.append(w)
                covered |= set(self.parts) if self.held[w] is ALL else self.held[w]
            if covered >= set(self.parts):
                break
        got = self.call_all(
            {w: self._actors[w].get_state.remote() for w in chosen}, "fetch the model state", self.timeout_s
        )
        state = dict(got[chosen[0]])
        state["model"], state["optimizer"] = {}, dict(state["optimizer"], state={})
        for w in chosen:
            state["model"].update(got[w]["model"])
            state["optimizer"]["state"].update(got[w]["optimizer"]["state"])
        state["parts"] = None
        return state

    def save_sharded(self, directory: str) -> None:
        """Every member writes its shard of the model state into ``directory`` (sharded model state)."""
        self.call_all(
            {w: self._actors[w].save_sharded.remote(directory) for w in self.worker_ids}, "save", self.timeout_s
        )

    def set_state(self, state: dict) -> None:
        if "sharded_dir" in state:  # a sharded checkpoint: each member reads its own rows, on any world size
            d = state["sharded_dir"]
            self.call_all({w: self._actors[w].load_sharded.remote(d) for w in self.worker_ids}, "load", self.timeout_s)
            return
        ref = ray.put(state)
        self.call_all({w: self._actors[w].set_state.remote(ref) for w in self.worker_ids}, "load state", self.timeout_s)
        for w in self.worker_ids:
            self.held[w] = ALL if state.get("parts") is None else frozenset(state["parts"])

    def call(self, method: str, *args) -> list:
        """Call a worker method on every rank and wait; results in rank order (e.g. 'parameters_digest')."""
        refs = {w: getattr(self._actors[w], method).remote(*args) for w in self.worker_ids}
        out = self.call_all(refs, method, self.timeout_s + 30)
        return [out[w] for w in self.worker_ids]

    def state_versions(self, timeout_s: float) -> dict[int, int]:
        """{worker id: optimizer steps in the state it holds} of the members that answer within ``timeout_s``; one
        that does not (dead or hung) is left out (and killed, as :meth:`settle` does)."""
        refs = {w: self._actors[w].state_version.remote() for w in self.worker_ids}
        results, _ = self.settle(refs, timeout_s)
        return {w: int(v) for w, v in results.items()}

    def shutdown(self) -> None:
        """Stop the workers' heartbeats (a bounded wait: a hung worker does not answer), kill the workers, then
        drop the stores: a beat into a store already closed prints a C++ stack trace on the worker."""
        actors = list(self._actors.values()) + [j[0] for j in self.joining.values()]
        stops = [s.remote() for s in (getattr(a, "stop_heartbeat", None) for a in actors) if s is not None]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=STOP_BEATS_S)
        for actor in actors:
            ray.kill(actor, no_restart=True)
        self._actors.clear()
        self.joining.clear()
        self.store = None
        self.heartbeats = None
