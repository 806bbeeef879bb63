"""An in-process stand-in for a Ray cluster of workers, for stepping the real ``TrainingDriver`` without Ray.

* :func:`memory_corpus`: a :class:`~flexorch.data.corpus.Corpus` whose blocks are numpy arrays in this process
  (the driver hands them to the worker group as they are; a store's block specs are opened as a worker would).
* :class:`FakeWorkerGroup`: the :class:`~flexorch.control.group.WorkerGroup` seam over :class:`FakeWorker` objects,
  each holding its own training state (model, AdamW, schedule of the real ``flexorch.workers.model`` /
  ``flexorch.workers.optim``). A step trains the step's documents with the single-process reference step
  (``flexorch.testing.reference``), so the parameters after a step are the real ones a distributed step reaches (the
  invariant: a plan changes where work runs, never what is computed); every rank that completes a step gets the
  same new state, as the gradient all-reduce gives real workers, and a rank that does not keeps its old one. States
  are immutable snapshots shared by reference (a step makes a new one), so a step costs one training step whatever
  the world's size. It keeps the real group's bookkeeping: stable worker ids, membership epochs, joiners and cluster
  slots, stage-local parameter holdings (``flexorch.work.placement``).
* Failure injection, as :class:`Fault` values: a worker dies or hangs during a step, dies while a world forms or
  while it hands off its state before leaving a draining node, or raises (a bug); capacity is a number of slots the
  test changes (:meth:`FakeWorkerGroup.add_slots`), optionally after some polls of the joiners (capacity that
  appears late).
* Nodes: worker ``w`` runs on node ``f"node-{w // per_node}"``; :meth:`FakeWorkerGroup.drain` starts draining one
  (reason preemption, a deadline), as ``ray drain-node`` does, and the node's slots go with its workers.
* Speeds: :meth:`FakeWorkerGroup.set_speed` makes a worker slow (0.5: half the others' pace) or fast again, mid-run.
  Once any speed is set, a rank reports each micro-batch's time as its group's time in the cost model (the run's
  profile, the group's sequences, degree, kind, placement and recompute mode: what the plan's price of the group is
  at one speed) over the slowest speed among the group's workers (a group runs at its slowest member's pace);
  before, the reference step's own time.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from flexorch.control.failures import Failure, MembershipFailure, Outcomes, WorkerGroupError
from flexorch.control.group import WorkerGroup
from flexorch.control.membership import Membership
from flexorch.data.corpus import Corpus
from flexorch.data.store.blocks import fetch_documents, open_blocks
from flexorch.testing.reference import reference_step
from flexorch.work.pipeline import PipelineWork
from flexorch.work.placement import ALL, missing_parts, model_parts, transfers
from flexorch.workers.model import init_model
from flexorch.workers.optim import build_optimizer
from flexorch.workers.step_exec import StepOutcome

__all__ = ["Fault", "FakeWorker", "FakeWorkerGroup", "memory_corpus"]


def memory_corpus(docs: list[np.ndarray], vocab_size: int, block_docs: int = 4) -> Corpus:
    """A corpus of the given token arrays, ``block_docs`` documents per block, blocks held as numpy arrays."""
    blocks, doc_blocks, doc_offsets = [], [], []
    for b in range(0, len(docs), block_docs):
        part = docs[b : b + block_docs]
        offsets = np.cumsum([0] + [len(d) for d in part[:-1]])
        blocks.append(np.concatenate(part).astype(np.int32))
        doc_blocks += [len(blocks) - 1] * len(part)
        doc_offsets += [int(o) for o in offsets]
    return Corpus(
        keys=[f"doc_{i:03d}" for i in range(len(docs))],
        lengths=np.array([len(d) for d in docs], dtype=np.int64),
        doc_blocks=np.array(doc_blocks, dtype=np.int64),
        doc_offsets=np.array(doc_offsets, dtype=np.int64),
        blocks=blocks,
        stats={"source": "memory", "docs": len(docs)},
        tokenizer_name="memory",
        vocab_size=vocab_size,
    )


@dataclass(frozen=True)
class Fault:
    """One injected failure: worker ``worker_id`` does ``action`` at ``point``.

    ``point``: "step" (during the step numbered ``at``, before its optimizer update), "join" (while the world of
    membership epoch ``at`` forms) or "handoff" (while it hands off its state in membership epoch ``at``, its node
    being drained). ``action``: "die" (its node is gone, and the node's slot with it), "hang" (it
    never answers: killed at the collective timeout and counted lost; its slot is free again), "break" (the world
    breaks, every worker alive: a network blip) or "raise" (a deterministic error, a bug)."""

    worker_id: int
    point: str
    at: int
    action: str = "die"

    def __post_init__(self) -> None:
        if self.point not in ("step", "join", "handoff") or self.action not in ("die", "hang", "break", "raise"):
            raise ValueError(f"bad fault {self}")


class FakeWorker:
    """One worker: the training state it holds, a snapshot (``get_state``'s dict) never changed in place."""

    def __init__(self, worker_id: int, state: dict, trainer: _Trainer):
        self.worker_id, self.state, self.trainer = worker_id, state, trainer

    def get_state(self) -> dict:
        return self.state

    def set_state(self, state: dict) -> None:
        self.state = state

    def parameters_digest(self) -> list:
        return [(k, v.numpy().copy()) for k, v in self.state["model"].items()]

    def info(self) -> dict:
        """What ``Worker.info`` says of a worker's kernels (the trainer runs the model eagerly on the CPU)."""
        return {"worker_id": self.worker_id, "attention": "attention kernel torch_cpu", "compiled_layers": 0}

    def stage_activation_bytes(self) -> tuple[float, float]:
        from flexorch.workers.calibrate import stage_activation_bytes

        return stage_activation_bytes(self.trainer.model, self.trainer.model.tok_embeddings.num_embeddings)


class _Trainer:
    """The math of a step: ``init_model`` / ``build_optimizer`` as a worker builds them, and the reference step."""

    def __init__(self, cfg):
        self.optim_cfg = cfg.optim
        self.model = init_model(cfg.model, cfg.seed)
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg.optim)
        self.initial = self.snapshot()

    def snapshot(self) -> dict:
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "rng": torch.get_rng_state(),
            "parts": None,
        }

    def step(self, state: dict, docs: list[np.ndarray]) -> tuple[dict, float, float]:
        """From ``state``, the reference step on the whole global batch: (new state, loss, learning rate)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))  # it would alias the snapshot's tensors
        self.scheduler.load_state_dict(state["scheduler"])
        loss = reference_step(self.model, self.optimizer, self.scheduler, docs, self.optim_cfg)
        return self.snapshot(), loss, self.scheduler.get_last_lr()[0]


@dataclass
class _Handle:
    """What one rank's ``run_step`` came to (settled at once: the fake computes during ``run_step``)."""

    outcome: StepOutcome | None = None
    lost: bool = False
    peer: bool = False
    error: str | None = None


class FakeWorkerGroup(WorkerGroup):
    """The :class:`~flexorch.control.group.WorkerGroup` seam in one process, with failure injection.

    ``slots``: device slots of the fake cluster (members and joiners each take one); ``faults``: :class:`Fault`
    values, each fires once."""

    def __init__(self, cfg, slots: int | None = None, faults=(), per_node: int = 2):
        self.cfg = cfg
        self.per_node = per_node
        self.draining: dict[str, float | None] = {}  # node -> deadline (unix seconds; None: none)
        self.slots = cfg.workers if slots is None else slots
        self.faults: list[Fault] = list(faults)
        self.fired: list[Fault] = []
        self.membership = Membership()
        self.workers: dict[int, FakeWorker] = {}
        self._joining: dict[int, int] = {}  # worker id -> polls until it is up
        self.retired: list[int] = []  # the workers removed on notice (retiring), in order
        self.handed_parts = 0  # the parts the last hand_off moved
        self.parts = model_parts(cfg.model.num_layers)
        self.held: dict[int, frozenset[str] | None] = {}
        self.worlds: list[tuple[int, ...]] = []  # every world formed, in order
        self._late: list[tuple[int, int]] = []  # (polls left, slots) capacity that appears after that many polls
        self.trainer = _Trainer(cfg)  # its initial state is what every new worker builds (same seed)
        self.speeds: dict[int, float] = {}  # worker id -> its pace (absent: 1.0); empty: measured times
        self.profile = None  # the cost model the modelled times come from (None: cfg.plan.profile's file)
        first = self.start_workers(min(cfg.workers, self.slots))
        self.admit(first)
        if self.size < cfg.min_workers:
            raise WorkerGroupError(f"only {self.size} slots for min_workers={cfg.min_workers}")

    # ---------------------------------------------------------------- the test's levers
    def add_slots(self, count: int, after_polls: int = 0) -> None:
        """Capacity joins the cluster: now, or after ``after_polls`` calls of :meth:`ready_joiners`."""
        if after_polls:
            self._late.append((after_polls, count))
        else:
            self.slots += count

    def drain(self, node: str, deadline_s: float | None) -> None:
        """Start draining ``node`` for preemption, its deadline ``deadline_s`` from now (None: no deadline)."""
        self.draining[node] = None if deadline_s is None else time.time() + deadline_s

    def set_speed(self, worker_id: int, speed: float) -> None:
        """From the next step on, ``worker_id`` runs at ``speed`` times the others' pace (1.0: theirs)."""
        if not speed > 0:
            raise ValueError(f"a speed must be > 0, got {speed!r}")
        self.speeds[worker_id] = float(speed)

    def pids_of(self) -> dict[int, int]:
        """Every fake worker runs in this process."""
        return dict.fromkeys(self.worker_ids, os.getpid())

    def inject(self, *faults: Fault) -> None:
        self.faults += faults

    def _take_fault(self, point: str, at: int, members) -> dict[int, str]:
        """The faults due now, by worker (each fires once); a dead worker's node takes its slot away."""
        due = [f for f in self.faults if f.point == point and f.at == at and f.worker_id in members]
        for f in due:
            self.faults.remove(f)
            self.fired.append(f)
            self.slots -= f.action == "die"
        return {f.worker_id: f.action for f in due}

    def _failure_of(self, hit: dict[int, str]) -> dict[int, str]:
        """Who is lost, who left the broken world, who raised: {worker id: 'lost' | 'peer' | 'error'}."""
        if any(a == "raise" for a in hit.values()):
            return {w: "error" if hit.get(w) == "raise" else "peer" for w in self.worker_ids}
        return {w: "lost" if hit.get(w) in ("die", "hang") else "peer" for w in self.worker_ids}

    # ---------------------------------------------------------------- membership
    @property
    def size(self) -> int:
        return self.membership.size

    @property
    def worker_ids(self) -> tuple[int, ...]:
        return self.membership.worker_ids

    @property
    def joining(self) -> dict[int, int]:
        """Worker id -> polls until it is up."""
        return self._joining

    def free_slots(self) -> int:
        return max(0, self.slots - self.size - len(self.joining))

    def nodes_of(self) -> dict[int, str]:
        return {w: f"node-{w // self.per_node}" for w in self.worker_ids}

    def rank_nodes(self) -> list[str | None]:
        return [f"node-{w // self.per_node}" for w in self.worker_ids]

    def leaving_notices(self) -> dict[int, float]:
        """No fake worker gets SIGTERM: a drain is told through :meth:`drain` alone."""
        return {}

    def draining_nodes(self) -> list:
        from flexorch.control.drains import NodeDrain

        return [NodeDrain(node, deadline, "unknown", f"10.0.0.{i + 7}") for i, (node, deadline) in
                enumerate(sorted(self.draining.items()))]  # fmt: skip

    def hand_off(self, leaving) -> dict:
        """Stage-local parameters only the leaving hold go to stayers (``handoff_needs``); replicas hold all."""
        from flexorch.work.placement import handoff_needs

        hit = self._take_fault("handoff", self.membership.epoch, leaving)
        if hit:  # the node went mid-handoff: the leaving are lost, the stayers' call saw the world go
            lost = frozenset(w for w, a in hit.items() if a in ("die", "hang"))
            peer = frozenset(self.worker_ids) - lost
            raise MembershipFailure("hand off the leaving workers' state", Failure(lost, peer, (), peer))
        needed = handoff_needs(self.held, self.worker_ids, sorted(leaving), self.parts)
        moved = self.place_params(needed)["moved_parts"] if needed is not None else 0
        self.handed_parts = moved
        return {"handoff_bytes": 0, "handoff_ms": 0.0}

    def start_workers(self, count: int) -> list[int]:
        ids = self.membership.new_ids(count)
        for wid in ids:
            self.joining[wid] = 1  # up at the next poll, if a slot is free for it
        return ids

    def ready_joiners(self, wait_s: float = 0.0) -> list[int]:
        self._late = [(n - 1, k) for n, k in self._late]
        self.slots += sum(k for n, k in self._late if n <= 0)
        self._late = [(n, k) for n, k in self._late if n > 0]
        room = self.slots - self.size
        ready = []
        for wid in sorted(self.joining):
            self.joining[wid] -= 1
            if self.joining[wid] <= 0 and len(ready) < room:
                ready.append(wid)
        if not ready and wait_s > 0:
            time.sleep(min(wait_s, 0.05))  # a real group waits on the actors' start; the fake polls on
        return ready

    def admit(self, worker_ids) -> None:
        for wid in worker_ids:
            self.joining.pop(wid, None)
            self.workers[wid] = FakeWorker(wid, self.trainer.initial, self.trainer)
            self.held[wid] = ALL
        self.membership.add(worker_ids)

    def remove(self, worker_ids, retiring: bool = False) -> None:
        if retiring:
            self.retired += worker_ids
        nodes = self.nodes_of()
        died = {f.worker_id for f in self.fired if f.action == "die"}  # their slots went already
        self.slots -= sum(nodes.get(w) in self.draining and w not in died for w in worker_ids)  # the node goes too
        for wid in worker_ids:
            self.workers.pop(wid)
            self.held.pop(wid, None)
        self.membership.remove(worker_ids)

    def form_world(self) -> float:
        epoch = self.membership.next_epoch()
        hit = self._take_fault("join", epoch, self.worker_ids)
        if hit:
            fate = self._failure_of(hit)
            lost = frozenset(w for w, f in fate.items() if f == "lost")
            peer = frozenset(w for w, f in fate.items() if f == "peer")
            errors = tuple((w, "RuntimeError: injected fault at join") for w, f in fate.items() if f == "error")
            raise MembershipFailure("form a torch.distributed world", Failure(lost, peer, errors))
        self.worlds.append(self.worker_ids)
        return 0.0

    def sync_state(self, source: int, targets) -> None:
        state = self.workers[source].get_state()
        for t in targets:
            if t != source:
                self.workers[t].set_state(state)
                self.held[t] = self.held[source]

    def missing_parts(self) -> list[str]:
        return missing_parts({w: self.held[w] for w in self.worker_ids}, self.parts)

    # ---------------------------------------------------------------- steps
    def place_params(self, needed_by_rank) -> dict:
        needed = {w: frozenset(needed_by_rank[r]) for r, w in enumerate(self.worker_ids)}
        moves = transfers({w: self.held[w] for w in self.worker_ids}, needed, self.parts)
        self.held.update(needed)
        return {
            "moved_parts": sum(len(ps) for s in moves.values() for ps in s.values()),
            "moved_bytes": 0,
            "move_ms": 0.0,
        }

    def run_step(self, work, block_specs: list[dict]) -> dict:
        """Run the step: every rank's documents are the batch (the union over the ranks' work, in doc-id order);
        the faults of this step decide who completes it."""
        ids = self.worker_ids
        step = work[0].step
        blocks = open_blocks({b: a for refs in block_specs for b, a in refs.items()})  # arrays, or store blocks
        docs = _batch_docs(work)
        hit = self._take_fault("step", step, ids)
        handles = {w: _Handle() for w in ids}
        if hit:  # before the gradient all-reduce: nobody updates; the survivors leave the broken world
            for w, fate in self._failure_of(hit).items():
                handles[w].lost, handles[w].peer = fate == "lost", fate == "peer"
                handles[w].error = f"RuntimeError: injected fault at step {step}" if fate == "error" else None
            return handles
        tokens = fetch_documents(blocks, docs)
        t0 = time.perf_counter()
        before = {id(self.workers[w].state) for w in ids}
        if len(before) != 1:
            raise RuntimeError(f"step {step}: the members hold {len(before)} different states (a missed state copy)")
        state, loss, lr = self.trainer.step(self.workers[ids[0]].state, tokens)
        ms = (time.perf_counter() - t0) * 1e3
        for w in ids:
            self.workers[w].set_state(state)
        for r, (w, rank_work) in enumerate(zip(ids, work, strict=True)):
            modelled = self.speeds and not isinstance(rank_work, PipelineWork)
            times, waits = self._modelled_ms(rank_work, w) if modelled else (None, None)
            handles[w].outcome = _outcome(rank_work, r, loss, ms, lr, times, waits)
        return handles

    def _modelled_ms(self, rank_work, worker: int) -> tuple[list[float], list[float]]:
        """Each of the rank's groups' times (its cost-model time over its slowest worker's speed) and what
        ``worker`` spent of it waiting for the slowest (the group's time less its own: the cost-model time over its
        own speed), as a CPU worker reports them."""
        from flexorch.control.membership import world_topology
        from flexorch.solver.cost_model import group_time_ms
        from flexorch.solver.profiles import load_profile

        if self.profile is None:
            self.profile = load_profile(self.cfg.plan.profile)
        topology = world_topology(self.worker_ids, self.rank_nodes(), self.size)
        ratio = self.profile.mode_time_ratios()
        out, waits = [], []
        for g in rank_work.work:
            if topology is not None:
                place = topology.placement(g.ranks, g.kind, g.ulysses_degree)
            else:
                place = {"ulysses_degree": g.ulysses_degree} if g.ulysses_degree is not None else {}
            t = group_time_ms([d.length for d in g.docs], g.degree, g.kind, self.profile, **place)
            t *= ratio[g.recompute] if g.recompute is not None else 1.0
            out.append(t / min(self.speeds.get(self.worker_ids[r], 1.0) for r in g.ranks))
            waits.append(out[-1] - t / self.speeds.get(worker, 1.0))
        return out, waits

    def settle(self, handles: dict, timeout_s: float) -> tuple[dict, Failure | None]:
        got = Outcomes(results={w: h.outcome for w, h in handles.items() if h.outcome is not None})
        got.lost = {w for w, h in handles.items() if h.lost}
        got.peer = {w for w, h in handles.items() if h.peer}
        got.errors = [(w, h.error) for w, h in handles.items() if h.error]
        return got.results, got.failure()

    def detection(self, lost) -> dict | None:
        """No heartbeats here: how a failure was found is not known."""
        return None

    # ---------------------------------------------------------------- state
    def get_state(self, rank: int = 0) -> dict:
        missing = self.missing_parts()
        if missing:
            raise WorkerGroupError(f"no member holds {missing}: the model state cannot be assembled")
        return self.workers[self.worker_ids[rank]].get_state()

    def set_state(self, state: dict) -> None:
        for w in self.worker_ids:
            self.workers[w].set_state(state)
            self.held[w] = ALL

    def save_sharded(self, directory: str) -> None:
        raise WorkerGroupError("the fake group holds no sharded model state")

    def stage_sharded(self, directory: str):
        raise WorkerGroupError("the fake group holds no sharded model state")

    def write_whole(self, directory: str, background: bool):
        return None  # the fake workers' state is in this process: the driver writes it (get_state)

    def call(self, method: str, *args) -> list:
        return [getattr(self.workers[w], method)(*args) for w in self.worker_ids]

    def state_versions(self, timeout_s: float) -> dict[int, int]:
        return {w: int(self.workers[w].state["scheduler"]["last_epoch"]) for w in self.worker_ids}

    def shutdown(self) -> None:
        self.workers.clear()
        self.joining.clear()


def _batch_docs(work) -> list:
    """The step's documents, each once, in doc-id order (a canonical order: the batch's loss and gradients are the
    same in any order up to float rounding, and the tests' reference packs them the same way)."""
    if isinstance(work[0], PipelineWork):
        docs = {d.doc_id: d for d in work[0].docs}
    else:
        docs = {d.doc_id: d for t in work for g in t.work for d in g.docs}
    return [docs[i] for i in sorted(docs)]


def _outcome(rank_work, rank: int, loss: float, ms: float, lr: float, times=None, waits=None) -> StepOutcome:
    """Rank ``rank``'s report: the real loss, the rank work's own micro-batches or ops, the step's time on each (SP:
    ``times``, one per micro-batch of the rank, when given, and ``waits``, what it waited of each)."""
    if isinstance(rank_work, PipelineWork):
        ops = [
            {"kind": k, "unit": u, "start_ms": i * ms, "end_ms": (i + 1) * ms}
            for pipe in rank_work.pipelines
            for i, (k, u) in enumerate(pipe.ops)
        ]
        local = sum(d.length for d in rank_work.docs) if rank_work.stage is not None else 0
        return StepOutcome(rank_work.step, rank, loss, rank_work.num_predicted, local, compute_end_ms=ms,
                           total_ms=ms, lr=lr, ops=ops, peak_local_tokens=local)  # fmt: skip
    mbs = [w.micro_batch for w in rank_work.work]
    local = [sum(d.length for d in w.docs) // w.degree for w in rank_work.work]
    times = [ms] * len(mbs) if times is None else list(times)
    starts = [sum(times[:i]) for i in range(len(mbs))]
    return StepOutcome(
        rank_work.step, rank, loss, rank_work.num_predicted, sum(local), micro_batch_ms=times,
        micro_batches=mbs, micro_batch_start_ms=starts, compute_end_ms=sum(times),
        total_ms=sum(times), lr=lr, peak_local_tokens=max(local, default=0), wait_ms=list(waits or []),
    )  # fmt: skip


def fake_driver(cfg, corpus, slots: int | None = None, faults=(), **group_kw):
    """The real ``TrainingDriver`` over a :class:`FakeWorkerGroup` (``group_kw``: its other arguments, e.g.
    ``per_node``) and the in-process planner; set up."""
    from flexorch.control.driver import TrainingDriver
    from flexorch.control.planner_client import LocalPlannerClient

    group = FakeWorkerGroup(cfg, slots, faults, **group_kw)
    driver = TrainingDriver(cfg, worker_group=group, planner=LocalPlannerClient, corpus=corpus)
    driver.setup()
    return driver, group
