"""The TrainingDriver: owns the data stream, the step loop, the planner and the workers (docs/design.md §1).

Every step: (1) take the next global batch from the stream (lengths are known before any token moves); (2) get
its plan, which the planner computed while the previous step ran; (3) send each worker its
:class:`~flexorch.work.step.StepWork`: where its documents lie (``DocRef``: block, offset, length) and the specs of
the token blocks it reads; workers read the tokens from the store (memory map, or range reads from ``s3://`` and
``gs://``: ``flexorch.data.store.blocks``), never through the driver; (4) ask the planner for the next batch's plan,
so the solve overlaps this step; (5) wait for the outcomes, record plan and outcome in ``steps.jsonl``, checkpoint
when due. :meth:`TrainingDriver.step` is one transition, returned as a value (``control.transitions.Transition``).
Workers and planner come through two seams, a ``control.group.WorkerGroup`` (default ``RayWorkerGroup``) and a
planner client factory (default ``RayPlannerClient``): tests step the real driver without Ray on an in-process fake
group and ``LocalPlannerClient``.

The driver is the one place that executes decisions (plans, recoveries, roll-backs, refits) on the run's state
(step, stream position, records, checkpoints). It is one class built from components, each owning its state and
given what it needs: the start (``control.run_setup``: ``RunStart`` builds the ``RunParts``), each step's plan
(``control.step_plans``), each worker's speed (``control.speed_watch``), the checkpoints (``control.checkpointer``),
the end (``control.run_end``), a lost driver's recovery (``control.driver_restart``), the profile
(``control.profile_revisions``), what runs beside each step (``control.step_callbacks``) and what differs by kind of
step (``control.step_kinds``).

Threads: the driver actor runs up to 4 calls at once (``max_concurrency=4``) and the drain watch has a thread.
The run loop's thread (:meth:`run`, or a caller of :meth:`setup` and :meth:`step`) alone steps, plans, records and
checkpoints. The CLI's calls come on other threads: :meth:`poll` reads the ``EventLog`` under its lock,
:meth:`request_stop` and :meth:`shutdown` write the ``RunEnd`` the loop reads between steps (``shutdown`` closes the
workers and the planner under the loop, whose failures then are not the run's). The drain watch's thread publishes
through the ``EventLog``, marks drains for the boundary, and starts the smaller world's plan through
``StepPlans.without``, under the step plans' lock, which the run loop's plans ahead also take.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from flexorch.config import TrainConfig, config_from_dict
from flexorch.control.capacity import run_capacity
from flexorch.control.checkpoint import load_checkpoint
from flexorch.control.checkpointer import Checkpointer
from flexorch.control.driver_restart import DriverRestart
from flexorch.control.elastic import ElasticError, RollingBack
from flexorch.control.failures import MembershipFailure
from flexorch.control.fallback_watch import FallbackWatch
from flexorch.control.group import WorkerGroup
from flexorch.control.membership import RollBack
from flexorch.control.memory_budget import lowered_after_oom
from flexorch.control.planner_client import PlannerFactory, RayPlannerClient
from flexorch.control.profile_revisions import ProfileRevisions
from flexorch.control.run_end import RunEnd
from flexorch.control.run_setup import RunParts, RunStart, where_it_runs
from flexorch.control.step_callbacks import StepCallback
from flexorch.control.step_kinds import StepKind, step_kinds
from flexorch.control.step_plans import StepPlans
from flexorch.control.transitions import EventLog, Ran, StepRun, Transition
from flexorch.records.trackers import Trackers
from flexorch.records.writer import skip_record, step_record
from flexorch.solver.errors import InfeasibleBatchError
from flexorch.solver.profiles import Profile
from flexorch.solver.step_planner import PlannedStep

__all__ = ["TrainingDriver"]


class TrainingDriver:
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
        # this driver replaces a lost one (flexorch.cli.train): its recovery goes with the first step past the lost's
        self._restart = DriverRestart(restarted) if restarted else None
        self.cfg = config if isinstance(config, TrainConfig) else config_from_dict(config)
        # how lost workers are asked for (control.capacity): None when [elastic] request_capacity is off
        self._capacity = run_capacity(self.cfg, worker_group, capacity_request)
        self.run_dir = Path(self.cfg.run_dir)
        self.step_no = 0
        self.skipped_batches = 0
        self.resumed_from: int | None = None
        self.events = EventLog()
        self._publish = self.events.publish
        self.callbacks: list[StepCallback] = []  # beside every step, in order (control.step_callbacks); by setup()
        self._rolled_back: list[dict] = []  # a roll-back to the last checkpoint, recorded with the next step
        # the profile planned with, the revisions records name, and the refit loop
        self.revisions = ProfileRevisions.for_run(self.cfg, self._publish)
        # the run's parts, built by setup() (control.run_setup.RunParts), each owned by this driver from then on
        self.stream = self.elastic = self.checkpoints = self.planner = self.records = self.metrics = self.speeds = None
        self.workers: WorkerGroup | None = None
        self.plans: StepPlans | None = None  # each step's plan; the drain watch's thread calls it too
        self.trackers: Trackers | None = None  # [tracking]: TensorBoard, MLflow, W&B, fed every record
        self.checkpointer: Checkpointer | None = None
        self.end = RunEnd(self.events, self._publish)  # a stop asked for, a shutdown under the loop, the error
        self._fallbacks = FallbackWatch(self._publish)  # warns once when many recent steps fell back
        self.step_started = 0.0  # when the step being recorded began: the progress callback's ETA
        self.kinds = step_kinds(self.cfg)  # SP (multi-task) or pipelined: what differs, keyed by StepKind
        self._start = RunStart(
            self.cfg,
            self._publish,
            corpus=corpus,
            workers=worker_group,
            capacity=self._capacity,
            planner_factory=planner or RayPlannerClient,
            revisions=self.revisions,
            fallbacks=self._fallbacks,
            save=lambda: self.checkpointer.save(self.step_no, self.workers, wait=False),  # async: the steps go on
            started=lambda: self.step_started,
        )  # what setup() builds the run's parts with

    def setup(self) -> dict:
        """Read the data, start the workers, resume when asked, find the profile, start the planner, records and
        trackers (``control.run_setup``); returns the ``setup`` event it published."""
        try:
            self._start.build()
        finally:  # the parts built, also by a start that failed part way: what failed, and what shutdown() closes
            self._take(self._start.parts)
        if self._restart is not None:  # the lost driver's replacement is set up: re-run from its checkpoint now
            self._restart.set_up(self.step_no, float(self.corpus.stats.get("load_s", 0.0)))
        return self._start.parts.summary

    def _take(self, parts: RunParts) -> None:
        """Own the parts the start built, and build the components that need them."""
        self.cfg, self.corpus, self.stream, self.workers = parts.cfg, parts.corpus, parts.stream, parts.workers
        self.elastic, self.plans, self.planner, self.speeds = parts.elastic, parts.plans, parts.planner, parts.speeds
        self.records, self.metrics, self.trackers = parts.records, parts.metrics, parts.trackers
        self.callbacks, self.checkpoints = parts.callbacks, parts.checkpoints
        if parts.checkpoints is not None:
            self.checkpointer = Checkpointer(
                parts.checkpoints, self._driver_state, self._publish, asynchronous=parts.cfg.checkpoint.async_
            )
        if parts.resumed_from is not None:
            self.step_no = self.resumed_from = parts.resumed_from
            self.skipped_batches = parts.skipped_batches
            self.checkpointer.resumed(self.step_no)

    def _driver_state(self) -> dict:
        """What a checkpoint keeps of the driver beside the model: stream position, skipped batches, config."""
        return {
            "stream": self.stream.state_dict(),
            "skipped_batches": self.skipped_batches,
            "config": self.cfg.to_dict(),
        }

    def where(self) -> dict:
        """Where this driver runs (its planner runs beside it): node id, IP, pid."""
        return where_it_runs()

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
        except RollingBack as e:  # while admitting workers, or a drained node's leave that missed a shard
            return self._roll_back(e.decision, e.decision.what or "admit joining workers", [])
        boundary_ms = (time.perf_counter() - t_start) * 1e3
        batch = self.stream.peek()  # taken (next_batch) only once the step is done or skipped
        carried, self._rolled_back = self._rolled_back, []
        run = StepRun(batch, [int(x) for x in self.corpus.lengths[list(batch.doc_ids)]], carried + changes)
        run.task_epochs = self.stream.task_epochs()  # [[tasks]]: each task's own epoch
        run.mixed = self.stream.sources(batch, self.corpus.lengths)  # [[data.sources]]: what came from each
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
            work = self.kinds[StepKind.of(planned)].rank_work(planned, docs, self.step_no, self.profile, base)
            results, failure, moved, dispatch_ms = self._dispatch(work, planned, n, run.attempt, t_dispatch)
            if failure is None:
                outcomes = [results[w] for w in self.workers.worker_ids]
                break
            try:
                outcomes = self._recover_attempt(run, failure, results, base)
            except RollingBack as e:  # model state whose every holder died: back to the checkpoint
                self._rolled_back = carried  # an earlier roll-back is still recorded with the next trained step
                return self._roll_back(e.decision, f"run step {self.step_no}", run.recoveries[len(carried) :])
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
        self.checkpointer.poll()  # a save written in the background and done: complete, reported
        driver_goes = self.elastic.driver_drained()  # said once per drain
        if driver_goes or self.elastic.may_leave(self.cfg.elastic):  # copies in flight finish before a node goes
            self.checkpointer.wait("the driver's node or members' nodes may go at this step boundary")
        if driver_goes and self.checkpointer.at != self.step_no:
            self.checkpoint()  # this node is going: its replacement driver starts from here, nothing re-run
        drained = self.elastic.leave_drained(self.step_no - 1, self._plan_next_for)  # draining nodes' workers first
        drained += self.elastic.retire_slow(self.speeds, self.cfg.elastic, self.step_no - 1, self._plan_next_for)
        joined = self.elastic.at_boundary()
        self._ask_capacity(joined)
        return drained + ([joined] if joined else [])

    def _plan_next_for(self, n: int) -> None:
        """Start solving the next batch's plan for ``n`` workers (the world after this boundary) while it re-forms."""
        if n >= 1 and not self.finished:
            self._plan_ahead(self.stream.peek(), n)

    def _plan_ahead(self, batch, n: int) -> None:
        """Start solving ``batch``'s plan for ``n`` workers (within the plan budget); a later plan call takes it."""
        self.plans.ahead_of(batch, n)

    def _plan_attempt(self, run: StepRun, n: int, boundary_ms: float) -> tuple[PlannedStep, dict]:
        """The plan of this attempt at the batch on ``n`` workers (planned ahead while the last step ran, or now),
        and the record fields every outcome of it has."""
        t_wait = time.perf_counter()
        planned = self.plans.plan(run.batch, run.lengths, n)
        wait_ms = (time.perf_counter() - t_wait) * 1e3
        base = run.base_fields(self.step_no, n, self.workers, planned, self.cfg.plan.mode, wait_ms, boundary_ms)
        return planned, base

    def _recover_attempt(self, run: StepRun, failure, results: dict, base: dict) -> list | None:
        """An attempt failed: the elastic policy decides and the driver executes (a ``ReplanForMemory``: the step
        is planned again for less memory per worker; the recovery: ``Elastic.recover``). The outcomes when
        survivors finished the update before the failure (the step stands); None when the batch runs again. Raises
        ``RollingBack`` when the run must go back to its checkpoint."""
        replan = self.elastic.policy.on_out_of_memory(failure)
        oom = None
        if replan is not None:  # the same batch is planned again, for less memory per worker
            profile, oom, message = lowered_after_oom(self.profile, replan.workers, self.step_no, replan.messages)
            self.revisions.replace(profile)
            self._publish({"event": "planner", "message": message})
        recovery = self.elastic.recover(failure, run.attempt, f"run step {self.step_no}")
        if oom is not None:
            recovery = dataclasses.replace(recovery, out_of_memory=oom)
        run.recoveries.append(recovery.to_record())
        run.rerun_from = time.perf_counter()  # the recovered step runs again (or stands) from here
        run.attempt = recovery.attempt + 1
        if recovery.step_completed:
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
        self.plans.last_step_ms = measured_ms
        priced_by = self.revisions.priced_by(planned)
        level = self.revisions.level(planned, priced_by)
        record = step_record(base, planned, priced_by, outcomes, measured_ms, dispatch_ms, level)
        if run.mixed is not None:
            record["sources"] = run.mixed
        kind = self.kinds[StepKind.of(planned)]
        kind.add_fields(record, planned, docs, moved, run.task_epochs)  # then each rank's speed, node, pid:
        self.speeds.observe(record, priced_by, base["worker_ids"], base["nodes"], self.workers.pids_of())
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

    def _dispatch(self, work, planned, n: int, attempt: int, t_dispatch: float):
        """Move stage-local parameters where the step needs them, start every rank's part, plan the next batch
        meanwhile and wait: (results, failure or None, what moved or None, ms until every rank was started)."""
        kind = self.kinds[StepKind.of(planned)]
        try:
            moved = kind.before_start(work, self.workers)  # stage-local parameters to their stage
        except MembershipFailure as e:  # a worker died while parameters moved: nobody has run the step
            return {}, dataclasses.replace(e.failure, completed=frozenset()), None, 0.0
        block_specs = self.corpus.block_specs_each(t.blocks() for t in work)  # specs, not tokens
        refs = self.workers.run_step(work, block_specs)
        dispatch_ms = (time.perf_counter() - t_dispatch) * 1e3
        if self.step_no + 1 < self.cfg.steps and attempt == 0:  # plan the next batch while this one runs
            self._plan_ahead(self.stream.peek_after(), n)  # with GPU workers, a budget share of the step it overlaps
        # a backstop only: a dead worker fails at once, a stuck collective fails on the worker after its timeout
        timeout_s = self.cfg.elastic.collective_timeout_s * (kind.waits(planned) + 2)
        results, failure = self.workers.settle(refs, timeout_s)
        return results, failure, moved, dispatch_ms

    def _roll_back(self, decision: RollBack, what: str, taken: list[dict]) -> Transition:
        """Execute the policy's roll-back (every holder of some model state was lost): load the last checkpoint on
        the workers alive and continue from its step; the steps after it are trained again on the same batches, and
        their records are rewritten (the roll-back is recorded with the next step). Without a checkpoint the run
        stops with what to do. ``taken``: membership changes made before the loss showed, during this transition."""
        self.checkpointer.wait("a roll-back to the last checkpoint")  # a save in flight completes or fails first
        ckpt = self.checkpoints.own  # the newest checkpoint this run wrote or resumed from (never an older run's)
        if ckpt is None:
            raise ElasticError(
                f"{what}: {decision.reason}, and this run has written no checkpoint yet to roll back to. Set "
                "checkpoint_every (a pipelined run with pipeline.params = 'stage' rolls back to its last checkpoint "
                "when every holder of a stage's parameters is lost), or pipeline.params = 'replicated' (every worker "
                "keeps the whole model)"
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
            callback.on_rewind(self.step_no)
        self.planner.forget()
        world = list(self.workers.worker_ids)
        rec = dict(what=what, rollback=True, lost=list(decision.lost), reason=decision.reason, from_step=from_step)
        rec.update(to_step=self.step_no, world_before=world, world_after=world)
        if decision.drain:  # the lost workers' node was being drained (control.elastic)
            rec["drain"] = decision.drain
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
        if self._restart is not None:  # a lost driver: its recovery goes with the first step past its last
            self._restart.lived(record)
        record = self.records.append(record)
        self.step_started = t_start  # the step's wall time, for the progress callback's ETA
        for callback in self.callbacks:  # trackers, metrics, fallback warning, checkpoint, progress
            callback.on_step(record, plan)
        return record

    def request_stop(self, reason: str) -> None:
        """Stop after the step in flight (a signal: SIGTERM from ``ray job stop`` or a preemption, SIGINT from
        Ctrl-C): :meth:`run` then writes a checkpoint and returns with ``stopped`` set. From the CLI's thread."""
        self.end.request_stop(reason, self.step_no)

    def checkpoint(self) -> str:
        """This run's checkpoint after :attr:`step_no` steps, complete; its path (None: an async write failed)."""
        return self.checkpointer.save(self.step_no, self.workers)

    def run(self) -> dict:
        """Step until ``steps`` are done, checkpoint at the end; errors are published, then raised."""
        try:
            if self.workers is None:
                self.setup()
            while not self.finished and self.end.reason is None:
                self.step()  # a roll-back goes back to the checkpoint's step: the loop trains it again
            path = self.checkpointer.at_end(self.step_no, self.workers)  # a periodic one of this step is kept
            return self.end.done(self.step_no, self.skipped_batches, path, str(self.records.path))
        except Exception as e:
            if self.end.closing:  # shutdown() took the workers away under the loop: that is not the run's error
                return self.end.stopped(self.step_no)
            err = e
            if self.planner is not None:  # set up: the loop had begun; keep its work (control.emergency)
                resume = f"go on with `flexorch train --config {self.run_dir}/config.json --resume`"
                err = self.checkpointer.keep_work(e, self.step_no, self.workers, resume)
            self.end.failed(err)
            if err is e:
                raise
            raise err from e
        finally:
            self.end.close(self.trackers)

    def poll(self, since: int) -> tuple[list[dict], bool]:
        """Events after index ``since`` and whether the run has ended (the CLI polls the driver actor)."""
        return self.events.poll(since)

    def replica_parameters(self) -> list:
        """Every rank's parameters (tests check the replicas are identical and match the reference)."""
        return self.workers.call("parameters_digest")

    def shutdown(self) -> None:
        """Stop the workers and the planner (after a save in flight). Called while :meth:`run` is still going (a
        second Ctrl-C, the CLI failing), the loop is told to stop and what then fails in it is not the run's error."""
        self.end.shutdown_came()
        if self.checkpointer is not None:  # a save in flight completes (or fails) while the workers still live
            self.checkpointer.wait("shutting down")
        self.revisions.close()
        for part in (self.elastic, self._capacity, self.trackers):  # the drain watch's thread, the autoscaler's ask
            if part is not None:
                part.close()
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
        if self.planner is not None:
            self.planner.close()
            self.planner = None
