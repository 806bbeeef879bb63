"""The TrainingDriver: owns the data stream, the step loop, the planner and the workers (docs/design.md §1).

Every step: (1) take the next global batch from the stream (lengths are known before any token moves); (2) get
its plan, which the planner actor computed while the previous step ran; (3) send each worker its
:class:`~flexorch.work.step.StepWork` and the refs of the token blocks its documents live in (tokens go from the
object store to the workers, never through the driver); (4) ask the planner for the next batch's plan, so the
solve overlaps this step; (5) wait for the outcomes, record plan and outcome in ``steps.jsonl``, checkpoint when
due. :meth:`TrainingDriver.step` is one transition, returned as a value (``control.transitions.Transition``).
Workers and planner come through two seams, a ``control.group.WorkerGroup`` (default ``RayWorkerGroup``) and a
planner client factory (default ``RayPlannerClient``): tests step the real driver without Ray on an in-process fake
group and ``LocalPlannerClient``.

The driver is the one place that executes decisions (plans, recoveries, roll-backs, refits) on the run's state
(step, stream position, records, checkpoints). This file holds the step transition; the start is
``control.run_setup``, the loop, checkpoints and the end ``control.run_loop`` (both base classes of the driver);
what decides lives beside it (``control.membership``, ``control.elastic``, ``control.planner_client``,
``control.fallback_watch``, ``control.profile_revisions``).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import ray

from flexorch.config import TrainConfig, config_from_dict
from flexorch.control.capacity import run_capacity
from flexorch.control.checkpoint import load_checkpoint
from flexorch.control.elastic import ElasticError
from flexorch.control.fallback_watch import FallbackWatch
from flexorch.control.group import WorkerGroup
from flexorch.control.membership import world_topology
from flexorch.control.memory_budget import lowered_after_oom
from flexorch.control.planner_client import PlannerFactory, RayPlannerClient
from flexorch.control.profile_revisions import ProfileRevisions
from flexorch.control.run_loop import RunLoop
from flexorch.control.run_setup import RunSetup
from flexorch.control.settle import MembershipFailure
from flexorch.control.step_kinds import step_kinds
from flexorch.control.transitions import EventLog, Ran, StepRun, Transition
from flexorch.data.mixture import source_fields
from flexorch.records.trackers import Trackers
from flexorch.records.writer import skip_record, step_record
from flexorch.solver.errors import InfeasibleBatchError
from flexorch.solver.profiles import Profile
from flexorch.solver.step_planner import PlannedStep
from flexorch.solver.topology import Topology
from flexorch.work.placement import PartsLostError

__all__ = ["TrainingDriver", "TrainingDriverActor"]


class TrainingDriver(RunSetup, RunLoop):
    """The control plane of one run. Construct, :meth:`setup`, then :meth:`step` or :meth:`run`.

    ``worker_group``: the workers to drive (built by :meth:`setup` from the config when None); ``planner``: builds
    the planner client from a :class:`~flexorch.control.planner_client.PlannerSpec` once the profile is known
    (None: the Ray planner actor); ``corpus``: a loaded :class:`~flexorch.data.corpus.Corpus` (None: read
    ``data.source`` with Ray Data), which in-process drivers may share."""

    def __init__(
        self,
        config: dict | TrainConfig,
        *,
        worker_group: WorkerGroup | None = None,
        planner: PlannerFactory | None = None,
        corpus=None,
        restarted: dict | None = None,
        capacity_request=None,
    ):
        self.corpus = corpus
        # this driver replaces one that was lost (flexorch.cli.train): its recovery, recorded with the first step
        # past the one the lost driver was running
        self._restart = dict(restarted) if restarted else None
        self._given_workers = worker_group
        self._planner_factory = planner or RayPlannerClient
        self.cfg = config if isinstance(config, TrainConfig) else config_from_dict(config)
        # how lost workers are asked for (control.capacity): Ray's autoscaler SDK on a real cluster, a test's
        # function with a given worker group, none when [elastic] request_capacity is off
        self._capacity = run_capacity(self.cfg, worker_group, capacity_request)
        self.run_dir = Path(self.cfg.run_dir)
        self.step_no = 0
        self.skipped_batches = 0
        self.resumed_from: int | None = None
        self.events = EventLog()
        self._publish = self.events.publish
        self._error: str | None = None
        self.callbacks: list = []  # beside every step, in order (control.step_callbacks); set up by setup()
        self._rolled_back: list[dict] = []  # a roll-back to the last checkpoint, recorded with the next step
        self.revisions = ProfileRevisions(
            self.run_dir,
            refits=self.cfg.plan.refits,
            refit_every=self.cfg.plan.refit_every,
            static=self.cfg.plan.static is not None,
            publish=self._publish,
        )  # the profile planned with, the revisions records name, and the refit loop
        self._last_step_ms: float | None = None  # the last trained step's measured time: the next plans' budget
        self._budget_cap: float | None = None  # the memory budget an out-of-memory step lowered to (bytes)
        self.workers: WorkerGroup | None = None
        self.planner = None
        self.trackers: Trackers | None = None  # [tracking]: TensorBoard, MLflow, W&B, fed every record
        self._stop_reason: str | None = None  # set by request_stop: the loop ends after the step in flight
        self._closing = False  # shutdown() came while run() was still going: its failures are not the run's
        self._fallbacks = FallbackWatch(self._publish)  # warns once when many recent steps fell back
        self._checkpointed_at: int | None = None  # the step of the newest checkpoint this run has on disk
        self._last_checkpoint: str | None = None
        self.kinds = step_kinds(self.cfg)  # SP (multi-task) or pipelined: what differs, keyed by planned.pipelined

    # ---------------------------------------------------------------- one step
    @property
    def finished(self) -> bool:
        return self.step_no >= self.cfg.steps

    def step(self) -> Transition:
        """One transition: train the next global batch, skip it, or roll back to the last checkpoint.

        Membership changes between steps (workers that finished starting join here). When an attempt fails
        because workers died or hung, the elastic policy decides; on a shrink or a retry the same batch is
        re-planned for the world left and re-run, so no document is lost or trained twice (docs/design.md §4). When
        stage-local parameters lost their every holder the run goes back to its last checkpoint: a ROLLED_BACK
        transition, and the next call trains the checkpoint's next batch (``step`` never calls itself)."""
        if self.workers is None:
            raise RuntimeError("call setup() first")
        t_start, step_no = time.perf_counter(), self.step_no
        try:
            changes = self._at_boundary()
        except PartsLostError as e:  # while admitting workers, or a drained node's leave that missed a shard
            return self._roll_back(e, getattr(e, "what", "admit joining workers"), [])
        boundary_ms = (time.perf_counter() - t_start) * 1e3
        batch = self.stream.peek()  # taken (next_batch) only once the step is done or skipped
        carried, self._rolled_back = self._rolled_back, []
        run = StepRun(batch, [int(x) for x in self.corpus.lengths[list(batch.doc_ids)]], carried + changes)
        run.task_epochs = self.stream.epochs() if self.cfg.tasks else None  # [[tasks]]: each task's own epoch
        run.mixed = source_fields(self.stream, batch, self.corpus.lengths)  # [[data.sources]]: what came from each
        while True:
            n = self.workers.size
            if n < 1:  # the elastic policy fails before this; never ask for a plan for no worker
                raise ElasticError(f"step {self.step_no}: no worker is left to run it")
            planned, base = self._plan_attempt(run, n, boundary_ms)
            if planned.plan is None:
                self.stream.next_batch()
                record = self._skip(base, planned)
                return Transition(Ran.SKIPPED, step_no, self.step_no, record, tuple(run.recoveries[len(carried) :]))
            t_dispatch = time.perf_counter()
            docs = self.corpus.locate(list(batch.doc_ids))
            work = self.kinds[planned.pipelined].rank_work(planned, docs, self.step_no, self.profile, base)
            results, failure, moved, dispatch_ms = self._dispatch(work, planned, n, run.attempt, t_dispatch)
            if failure is None:
                outcomes = [results[w] for w in self.workers.worker_ids]
                break
            try:
                outcomes = self._recover_attempt(run, failure, results, base)
            except PartsLostError as e:  # stage-local parameters whose every holder died: back to the checkpoint
                self._rolled_back = carried  # an earlier roll-back is still recorded with the next trained step
                return self._roll_back(e, f"run step {self.step_no}", run.recoveries[len(carried) :])
            if outcomes is not None:  # some survivors finished the update before the failure: it stands
                break
        self.stream.next_batch()
        run.t_done = time.perf_counter()
        record = self._trained_record(run, planned, base, docs, outcomes, (t_dispatch, dispatch_ms, moved))
        record = self._finish(record, t_start, planned.plan)
        return Transition(Ran.TRAINED, step_no, self.step_no, record, tuple(run.recoveries[len(carried) :]))

    def _at_boundary(self) -> list[dict]:
        """Between steps: a checkpoint when this driver's node is drained, workers on draining nodes leave, ready
        joiners are admitted, and the autoscaler is asked for what the world lacks. The records of what changed."""
        if self.elastic.driver_drained() and self._checkpointed_at != self.step_no:
            self.checkpoint()  # this node is going: its replacement driver starts from here, nothing re-run
        drained = self.elastic.leave_drained(self.step_no - 1, self._plan_next_for)  # draining nodes' workers first
        joined = self.elastic.at_boundary()
        self._ask_capacity(joined)
        return drained + ([joined] if joined else [])

    def _plan_next_for(self, n: int) -> None:
        """Start solving the next batch's plan for ``n`` workers (a world about to change size at this boundary):
        the solve runs while the world re-forms, and :meth:`_plan_attempt` takes it."""
        if n >= 1 and not self.finished:
            self._plan_ahead(self.stream.peek(), n)

    def _plan_ahead(self, batch, n: int) -> None:
        """Start solving ``batch``'s plan for ``n`` workers (within the plan budget); a later plan call takes it."""
        lengths = [int(x) for x in self.corpus.lengths[list(batch.doc_ids)]]
        self._ahead = (batch.step, lengths, n, self._plan_budget(), self._task_of(batch))
        self.planner.plan_ahead(batch.step, lengths, n, self._ahead[3], topology=self._topology(n), **self._ahead[4])

    def _topology(self, n: int, without=()) -> Topology | None:
        """The nodes of a world of ``n`` workers: the members less ``without`` (``membership.world_topology``)."""
        if self.cfg.plan.topology == "blind":
            return None
        return world_topology(self.workers.worker_ids, self.workers.rank_nodes(), n, without)

    def _plan_without(self, workers: list[int]) -> None:
        """A drain was just seen on ``workers``' node (from the drain watch's thread, mid-step): also solve the
        next batch's plan for the world without them, so the step after their leave finds it solved."""
        ahead = getattr(self, "_ahead", None)
        if ahead is None:
            return
        step, lengths, n, budget, task = ahead
        m = n - len(set(workers) & set(self.workers.worker_ids))
        if 1 <= m < n:
            try:
                topology = self._topology(m, without=workers)
                self.planner.plan_ahead(step, lengths, m, budget, also=True, topology=topology, **task)
            except Exception:  # noqa: BLE001 - best effort: the boundary solves it otherwise
                pass

    def _plan_attempt(self, run: StepRun, n: int, boundary_ms: float) -> tuple[PlannedStep, dict]:
        """The plan of this attempt at the batch on ``n`` workers (planned ahead while the last step ran, or now),
        and the record fields every outcome of it has."""
        batch = run.batch
        t_wait = time.perf_counter()
        topology = self._topology(n)
        planned = self.planner.plan(
            batch.step, run.lengths, n, self._plan_budget(), topology=topology, **self._task_of(batch)
        )
        base = {
            "step": self.step_no,
            "epoch": batch.epoch,
            "batch_index": batch.index_in_epoch,
            "doc_ids": list(batch.doc_ids),
            "seq_lengths": run.lengths,
            "world_size": n,
            "worker_ids": list(self.workers.worker_ids),
            "nodes": self.workers.rank_nodes(),
            "mode": self.cfg.plan.mode,
            "solve_s": planned.solve_s,
            "plan_wait_ms": (time.perf_counter() - t_wait) * 1e3,
            "boundary_ms": boundary_ms,
            "baselines_ms": planned.baselines_ms,
            "recoveries": run.recoveries,
        }
        return planned, base

    def _recover_attempt(self, run: StepRun, failure, results: dict, base: dict) -> list | None:
        """An attempt failed: the elastic policy recovers (an out-of-memory step is planned again for less memory
        per worker). The outcomes when survivors finished the update before the failure (the step stands); None
        when the batch runs again. Raises PartsLostError when the run must go back to its checkpoint."""
        oom = None
        if failure.out_of_memory:  # the same batch is planned again, for less memory per worker
            profile, oom, message = lowered_after_oom(
                self.profile, failure.out_of_memory, self.step_no, failure.oom_messages
            )
            self._budget_cap = profile.memory_budget_bytes
            self.revisions.replace(profile)
            self._publish({"event": "planner", "message": message})
        rec = self.elastic.recover(failure, run.attempt, f"run step {self.step_no}")
        if oom is not None:
            rec["out_of_memory"] = oom
        run.recoveries.append(rec)
        run.rerun_from = time.perf_counter()  # the recovered step runs again (or stands) from here
        run.attempt = rec["attempt"] + 1
        if rec["step_completed"]:
            return [results.get(w) if w in failure.completed else None for w in base["worker_ids"]]
        return None

    def _trained_record(self, run: StepRun, planned: PlannedStep, base: dict, docs, outcomes, dispatched) -> dict:
        """The record of the trained step (the step number moves on): the plan, its price and the outcomes, with
        the time a recovery cost the user, checked against the batch's loss-target tokens."""
        t_dispatch, dispatch_ms, moved = dispatched
        if run.attempt:  # the time a user lived: detect (last sign of life -> failure seen), re-form, re-run
            rec = run.recoveries[-1]
            rec["rerun_ms"] = (run.t_done - run.rerun_from) * 1e3
            rec["total_ms"] = rec.get("detect_ms", 0.0) + rec["recovery_ms"] + rec["rerun_ms"]
        tokens = next(o for o in outcomes if o is not None).num_predicted
        want = sum(d.predicted for d in docs)  # loss-target tokens of the batch (text: sum of length - 1)
        if tokens != want:
            raise RuntimeError(f"step {self.step_no}: the workers trained {tokens} target tokens, the batch has {want}")
        measured_ms = (run.t_done - t_dispatch) * 1e3
        self._last_step_ms = measured_ms
        priced_by = self.revisions.priced_by(planned)
        level = self.revisions.level(planned, priced_by)
        record = step_record(base, planned, priced_by, outcomes, measured_ms, dispatch_ms, level)
        if run.mixed is not None:
            record["sources"] = run.mixed
        kind = self.kinds[planned.pipelined]
        kind.add_fields(record, planned, docs, moved, run.task_epochs)
        if kind.refits:
            self.revisions.after_step(record, self.step_no, priced_by)
        self.step_no += 1
        record["overhead_ms"] = (time.perf_counter() - run.t_done) * 1e3
        return record

    def _ask_capacity(self, joined: dict | None) -> None:
        """Ask the autoscaler for the workers the world lacks, or withdraw the request once they are back (a grow
        record says how long after the request they joined)."""
        if self._capacity is None:
            return
        event = self._capacity.update(self.workers.size)
        if event is None:
            return
        if joined is not None and "waited_s" in event:
            joined["capacity_wait_s"] = event["waited_s"]
        self._publish(event)

    @property
    def profile(self) -> Profile | None:
        """The profile the next plans are made with (``control.profile_revisions``)."""
        return self.revisions.profile

    def settle_refit(self, wait: bool = True) -> None:
        """Take up a refit that has finished (``wait``: wait for one in flight): on trial when it predicts its window
        better; the console says what it did."""
        self.revisions.settle(wait, self.step_no)

    def _plan_budget(self) -> float:
        """Seconds the next plan may take (``[plan] budget``): a share of the last measured step on GPU workers."""
        return self.cfg.plan.budget_for(self._last_step_ms, use_gpu=self.cfg.use_gpu)

    def _task_of(self, batch) -> dict:
        """``{"task_of": [...]}`` (each document's task) for the planner in a run of ``[[tasks]]``; {} otherwise (a
        run of one task plans without it)."""
        if not self.cfg.tasks:
            return {}
        return {"task_of": [int(x) for x in self.corpus.task_of[list(batch.doc_ids)]]}

    def _dispatch(self, work, planned, n: int, attempt: int, t_dispatch: float):
        """Move stage-local parameters where the step needs them, start every rank's part, plan the next batch
        meanwhile and wait: (results, failure or None, what moved or None, ms until every rank was started)."""
        kind = self.kinds[planned.pipelined]
        try:
            moved = kind.before_start(work, self.workers)  # stage-local parameters to their stage
        except MembershipFailure as e:  # a worker died while parameters moved: nobody has run the step
            return {}, dataclasses.replace(e.failure, completed=frozenset()), None, 0.0
        block_refs = [{b: self.corpus.shards[b] for b in sorted(t.blocks())} for t in work]  # specs, not tokens
        refs = self.workers.run_step(work, block_refs)
        dispatch_ms = (time.perf_counter() - t_dispatch) * 1e3
        if self.step_no + 1 < self.cfg.steps and attempt == 0:  # plan the next batch while this one runs
            self._plan_ahead(self.stream.peek_after(), n)  # with GPU workers, a budget share of the step it overlaps
        # a backstop only: a dead worker fails at once, a stuck collective fails on the worker after its timeout
        timeout_s = self.cfg.elastic.collective_timeout_s * (kind.waits(planned) + 2)
        results, failure = self.workers.settle(refs, timeout_s)
        return results, failure, moved, dispatch_ms

    def _roll_back(self, err: PartsLostError, what: str, taken: list[dict]) -> Transition:
        """Every holder of some parameters was lost (stage-local parameters): load the last checkpoint on the
        workers alive and continue from its step; the steps after it are trained again on the same batches, and
        their records are rewritten (the roll-back is recorded with the next step). Without a checkpoint the run
        stops with what to do. ``taken``: membership changes made before the loss showed, during this transition."""
        ckpt = self.checkpoints.own  # the newest checkpoint this run wrote or resumed from (never an older run's)
        if ckpt is None:
            raise ElasticError(
                f"{what}: {err}, and this run has written no checkpoint yet to roll back to. Set checkpoint_every (a "
                "pipelined run with pipeline.params = 'stage' rolls back to its last checkpoint when every holder of "
                "a stage's parameters is lost), or pipeline.params = 'replicated' (every worker keeps the whole model)"
            )
        t0 = time.perf_counter()
        state, dstate = load_checkpoint(ckpt)
        self.workers.set_state(state)
        self.stream.load_state_dict(dstate["stream"])
        from_step = self.step_no
        self.step_no = int(dstate["step"])
        self.skipped_batches = int(dstate.get("skipped_batches", 0))
        self.records.truncate(self.step_no)
        for callback in self.callbacks:
            if hasattr(callback, "on_rewind"):
                callback.on_rewind(self.step_no)
        self.planner.forget()
        world = list(self.workers.worker_ids)
        rec = dict(what=what, rollback=True, lost=sorted(err.lost_workers), reason=str(err), from_step=from_step)
        rec.update(to_step=self.step_no, world_before=world, world_after=world)
        if getattr(err, "drain", None):  # the lost workers' node was being drained (control.elastic)
            rec["drain"] = err.drain
        rec["recovery_ms"] = (time.perf_counter() - t0) * 1e3
        self._rolled_back.append(rec)
        self._publish({"event": "membership", **rec})
        return Transition(Ran.ROLLED_BACK, from_step, self.step_no, None, (*taken, rec))

    def _skip(self, base: dict, planned: PlannedStep) -> dict:
        if self.cfg.plan.on_infeasible == "error":
            raise InfeasibleBatchError(
                f"step {self.step_no}: no plan fits batch {base['batch_index']} of epoch {base['epoch']} "
                f"(documents {base['doc_ids'][:8]}..., longest {max(base['seq_lengths'])} tokens) on "
                f"{base['world_size']} workers: {planned.error}. Set plan.on_infeasible = 'skip' to skip such "
                "batches (they are counted and recorded), or lower data.max_context"
            )
        self.skipped_batches += 1
        record = skip_record(base, "infeasible", planned.error)
        self.step_no += 1
        return self._finish(record, time.perf_counter())

    def _finish(self, record: dict, t_start: float, plan=None) -> dict:
        """Write the record (as the file has it: schema and time added), export metrics, checkpoint, report."""
        if self._restart is not None and record["step"] >= self._restart["lost_step"]:
            rec, self._restart = self._restart, None  # a lost driver, lived: detect, restart, re-run to here
            rec["rerun_ms"] = (time.time() - self._restart_setup_at) * 1e3
            rec["redone_steps"] = record["step"] - rec["from_step"]
            rec["total_ms"] = rec.get("detect_ms", 0.0) + rec["recovery_ms"] + rec["rerun_ms"]
            record["recoveries"] = [*record["recoveries"], rec]
        record = self.records.append(record)
        self.step_started = t_start  # the step's wall time, for the progress callback's ETA
        for callback in self.callbacks:  # trackers, metrics, fallback warning, checkpoint, progress
            callback.on_step(record, plan)
        return record


TrainingDriverActor = ray.remote(num_cpus=0, max_concurrency=4)(TrainingDriver)
"""The driver as a Ray actor; ``run`` in one thread while the CLI calls ``poll`` from another."""
