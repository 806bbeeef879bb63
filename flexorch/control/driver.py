"""The TrainingDriver: owns the data stream, the step loop, the planner and the workers (docs/design.md §1).

Every step: (1) take the next global batch from the stream (lengths are known before any token moves); (2) get
its plan, which the planner actor computed while the previous step ran; (3) send each worker its
:class:`~flexorch.tasks.step.StepTask` and the refs of the token blocks its documents live in (tokens go from the
object store to the workers, never through the driver); (4) ask the planner for the next batch's plan, so the
solve overlaps this step; (5) wait for the outcomes, record plan and outcome in ``steps.jsonl``, checkpoint when
due. :meth:`TrainingDriver.step` is one transition, returned as a value (``control.transitions.Transition``);
:meth:`run` loops it and publishes progress events the CLI polls. Workers and planner come through two seams, a
``control.group.WorkerGroup`` (default ``RayWorkerGroup``) and a planner client factory (default
``RayPlannerClient``): tests step the real driver without Ray on an in-process fake group and ``LocalPlannerClient``.

One concept, kept whole: the driver is the one place that executes decisions (plans, recoveries, roll-backs, refits)
on the run's state (step, stream position, records, checkpoints), so setup, the step transition and the loop share
that state here; what decides lives beside it (``control.membership``, ``control.elastic``, ``control.planner_client``,
``control.fallback_watch``, ``control.refitting``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from pathlib import Path

import ray

from flexorch.config import ConfigError, TrainConfig, config_from_dict
from flexorch.config.sharding import uneven_world_note
from flexorch.control.calibration import model_state_fields, run_profile
from flexorch.control.capacity import LOCAL_RAY_ENV, CapacityRequest, ray_request, worker_bundle
from flexorch.control.checkpoint import RunCheckpoints, load_checkpoint
from flexorch.control.elastic import Elastic, ElasticError
from flexorch.control.emergency import save_after_error
from flexorch.control.fallback_watch import FallbackWatch
from flexorch.control.group import WorkerGroup
from flexorch.control.host_load import niced_on_busy_node
from flexorch.control.membership import ElasticPolicy
from flexorch.control.memory_budget import lowered_after_oom, resolve_device_budget
from flexorch.control.planner_client import PlannerFactory, PlannerSpec, RayPlannerClient
from flexorch.control.recompute_choice import with_recompute_ratios
from flexorch.control.refitting import RunRefit
from flexorch.control.transitions import EventLog, Ran, Transition
from flexorch.control.worker_group import MembershipFailure, RayWorkerGroup
from flexorch.data.bpe import prepare_tokenizer
from flexorch.data.corpus import load_corpus
from flexorch.data.mixture import MixtureStream, load_mixture, mixture_tokenizer, source_fields
from flexorch.data.stream import DocumentStream
from flexorch.data.task_corpus import TaskStreams, load_task_corpus, multitask_fields, task_fields, tasks_tokenizer
from flexorch.records.metrics import RunMetrics
from flexorch.records.trackers import Trackers
from flexorch.records.writer import StepRecords, skip_record, step_record
from flexorch.solver.errors import InfeasibleBatchError
from flexorch.solver.profiles import Profile
from flexorch.solver.recompute import recompute_modes
from flexorch.solver.step_planner import PlannedStep
from flexorch.tasks.pipeline import PipelineTask, pipeline_tasks
from flexorch.tasks.placement import PartsLostError
from flexorch.tasks.step import step_tasks

__all__ = ["TrainingDriver", "TrainingDriverActor"]


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
        # this driver replaces one that was lost (flexorch.cli.train): its recovery, recorded with the first step
        # past the one the lost driver was running
        self._restart = dict(restarted) if restarted else None
        self._given_workers = worker_group
        self._planner_factory = planner or RayPlannerClient
        self.cfg = config if isinstance(config, TrainConfig) else config_from_dict(config)
        # how lost workers are asked for (control.capacity): Ray's autoscaler SDK on a real cluster, a test's
        # function with a given worker group, none when [elastic] request_capacity is off
        self._capacity = _capacity(self.cfg, worker_group, capacity_request)
        self.run_dir = Path(self.cfg.run_dir)
        self.step_no = 0
        self.skipped_batches = 0
        self.resumed_from: int | None = None
        self.events = EventLog()
        self._publish = self.events.publish
        self._error: str | None = None
        self._step_wall: list[float] = []
        self._rolled_back: list[dict] = []  # a roll-back to the last checkpoint, recorded with the next step
        # the run's groups and steps, the refit on them and the one on trial
        self._refits = RunRefit(self.cfg.plan.refit_every, static=self.cfg.plan.static is not None)
        self._priced: dict[int, Profile] = {}  # profile revision -> the profile (a plan is priced with its own)
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

    # ---------------------------------------------------------------- setup
    def setup(self) -> dict:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        note = niced_on_busy_node()
        if note:
            self._publish({"event": "planner", "message": note})
        if self.corpus is None and cfg.tasks:  # [[tasks]]: each task's data, one id space (data.task_corpus)
            self.cfg = cfg = tasks_tokenizer(cfg, self.run_dir)
            self.corpus = load_task_corpus(cfg.tasks, publish=self._publish)
        elif self.corpus is None and cfg.data.sources:  # [[data.sources]]: a mixture, each source its own store
            self.cfg = cfg = cfg.replace(data=mixture_tokenizer(cfg.data, self.run_dir))
            self.corpus = load_mixture(cfg.data, publish=self._publish)
        elif self.corpus is None:  # 'bpe:N' is trained here (or reused) and becomes 'hf:<run_dir>/tokenizer'
            self.cfg = cfg = cfg.replace(data=prepare_tokenizer(cfg.data, self.run_dir))
            self.corpus = load_corpus(cfg.data, publish=self._publish)
        if self.corpus.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"tokenizer {self.corpus.tokenizer_name!r} has {self.corpus.vocab_size} ids but model.vocab_size="
                f"{cfg.model.vocab_size}; raise model.vocab_size to at least {self.corpus.vocab_size}"
            )
        if cfg.tasks:  # counts[t] documents of every task per batch, each task on its own epochs
            self.stream = TaskStreams(self.corpus, cfg.task_counts, cfg.seed)
        elif cfg.data.sources:  # each batch blended from the sources by their weights, each on its own epochs
            self.stream = MixtureStream.for_corpus(self.corpus, cfg.batch_size, cfg.seed)
        else:
            self.stream = DocumentStream(self.corpus.num_docs, cfg.batch_size, cfg.seed)
        sharded = cfg.sharding_mode != "replicate"
        self.checkpoints = RunCheckpoints(self.run_dir, self.corpus, cfg.keep_checkpoints, sharded=sharded)
        resumed = self.checkpoints.resume() if cfg.resume else None  # checked before any worker starts
        for message in self.checkpoints.skipped:  # newer damaged or partial checkpoints the resume passed over
            self._publish({"event": "checkpoint_skipped", "message": message})
        if self._capacity is not None and self._given_workers is None:  # an autoscaled cluster may start empty
            key = "GPU" if cfg.use_gpu else "CPU"
            slots = lambda: ray.cluster_resources().get(key, 0)  # noqa: E731
            self._capacity.await_start(cfg.workers, cfg.elastic.wait_s, slots, self._publish)
        self.workers = self._given_workers or RayWorkerGroup.from_config(cfg, publish=self._publish)
        policy = ElasticPolicy(cfg.min_workers, cfg.max_workers, cfg.elastic.wait_s, cfg.elastic.max_attempts)
        mode, shard = cfg.sharding_mode, cfg.sharding.shard_size
        layout = functools.partial(uneven_world_note, mode, shard_size=shard)
        self.elastic = Elastic(self.workers, policy, self._publish, self.checkpoints.hint, layout)
        t_world = time.perf_counter()
        try:
            self.workers.form_world()
        except MembershipFailure as e:
            self.elastic.recover(e.failure, 0, "form the first world")
        world_s = time.perf_counter() - t_world
        self.elastic.reform_s = world_s
        self.elastic.watch_drains()  # nodes being drained are seen within a second; their workers leave between steps
        if resumed is not None:
            state, dstate = resumed
            self.stream.load_state_dict(dstate["stream"])
            self.step_no = self.resumed_from = self._checkpointed_at = int(dstate["step"])
            self._last_checkpoint = str(self.checkpoints.own.path)
            self.skipped_batches = int(dstate.get("skipped_batches", 0))
            self.workers.set_state(state)
        self.cfg, budget = resolve_device_budget(cfg, self.workers, self._publish)  # tokens_per_worker = 'auto'
        cfg = self.cfg
        act_budget = budget.activation_bytes if budget is not None else None
        self.profile = run_profile(cfg, self.workers, self.run_dir, self._publish, act_budget)
        say = lambda message: self._publish({"event": "progress", "message": message})  # noqa: E731
        self.profile = with_recompute_ratios(cfg, self.workers, self.profile, say)  # 'auto' recompute's terms
        self.profile = self._start_revision(self.profile, resumed is not None)
        self.planner = self._planner_factory(PlannerSpec.for_run(cfg, self.profile), self._publish)
        self.records = StepRecords(self.run_dir, keep_before_step=self.step_no if resumed is not None else None)
        self.metrics = RunMetrics(self.run_dir.name)
        (self.run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1, default=list))
        self.trackers = Trackers.open(cfg.tracking, self.run_dir, cfg.to_dict(), self.resumed_from, say=say)
        summary = {
            "event": "setup",
            "corpus": self.corpus.stats,
            "num_docs": self.corpus.num_docs,
            "batches_per_epoch": self.stream.batches_per_epoch,
            "workers": self.workers.size,
            "min_workers": cfg.min_workers,
            "max_workers": cfg.max_workers,
            "world_s": world_s,
            "profile": self.profile.name,
            "tokens_per_worker": self.profile.tokens_per_device,
            "group_tokens_per_worker": cfg.tokens_per_worker,
            "resumed_from": self.resumed_from,
            "steps": cfg.steps,
            "model_params": cfg.model.num_params(),
            "pipeline_stages": cfg.pipeline.stages,
            "sharding": model_state_fields(cfg, self.workers.size),
            "kernels": {k: self.workers.call("info")[0].get(k) for k in ("attention", "compiled_layers")},
        }
        self._publish(summary)
        if self._restart is not None:  # the lost driver's replacement is set up: re-run from its checkpoint now
            self._restart_setup_at = time.time()
            self._restart["recovery_ms"] = (self._restart_setup_at - self._restart.pop("seen_at")) * 1e3
            self._restart["from_step"] = self.step_no
            self._restart["corpus_ms"] = float(self.corpus.stats.get("load_s", 0.0)) * 1e3  # of the new driver's
        return summary

    def where(self) -> dict:
        """Where this driver runs (its planner runs beside it): node id, IP, pid."""
        import os

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
        }

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
            if self.elastic.driver_drained() and self._checkpointed_at != self.step_no:
                self.checkpoint()  # this node is going: its replacement driver starts from here, nothing re-run
            drained = self.elastic.leave_drained(self.step_no - 1)  # workers on draining nodes leave first
            joined = self.elastic.at_boundary()
            self._ask_capacity(joined)
        except PartsLostError as e:  # while admitting workers, or a drained node's leave that missed a shard
            return self._roll_back(e, getattr(e, "what", "admit joining workers"), [])
        boundary_ms = (time.perf_counter() - t_start) * 1e3
        batch = self.stream.peek()  # taken (next_batch) only once the step is done or skipped
        task_epochs = self.stream.epochs() if self.cfg.tasks else None  # [[tasks]]: each task's own epoch
        mixed = source_fields(self.stream, batch, self.corpus.lengths)  # [[data.sources]]: what came from each
        lengths = [int(x) for x in self.corpus.lengths[list(batch.doc_ids)]]
        carried, self._rolled_back = self._rolled_back, []
        recoveries = carried + drained + ([joined] if joined else [])
        attempt = 0
        while True:
            n = self.workers.size
            if n < 1:  # the elastic policy fails before this; never ask for a plan for no worker
                raise ElasticError(f"step {self.step_no}: no worker is left to run it")
            t_wait = time.perf_counter()
            planned = self.planner.plan(batch.step, lengths, n, self._plan_budget(), **self._task_of(batch))
            plan_wait_ms = (time.perf_counter() - t_wait) * 1e3
            base = {
                "step": self.step_no,
                "epoch": batch.epoch,
                "batch_index": batch.index_in_epoch,
                "doc_ids": list(batch.doc_ids),
                "seq_lengths": lengths,
                "world_size": n,
                "worker_ids": list(self.workers.worker_ids),
                "mode": self.cfg.plan.mode,
                "solve_s": planned.solve_s,
                "plan_wait_ms": plan_wait_ms,
                "boundary_ms": boundary_ms,
                "baselines_ms": planned.baselines_ms,
                "recoveries": recoveries,
            }
            if planned.plan is None:
                self.stream.next_batch()
                record = self._skip(base, planned)
                return Transition(Ran.SKIPPED, step_no, self.step_no, record, tuple(recoveries[len(carried) :]))
            t_dispatch = time.perf_counter()
            docs = self.corpus.locate(list(batch.doc_ids))
            if planned.pipelined:
                # sharded state: each stage's parts are FSDP units over its workers, never moved as whole parts
                stage_params = self.cfg.pipeline.params == "stage" and self.cfg.sharding_mode == "replicate"
                tasks = pipeline_tasks(
                    planned.plan, docs, self.step_no, stage_params=stage_params, tied=self.cfg.model.tie_embeddings
                )
            else:
                modes = recompute_modes(planned.plan, self.profile)  # 'auto' recompute: each group's mode
                if modes is not None:
                    base["recompute"] = [list(row) for row in modes]
                    if "recompute_packing" in planned.plan.meta:
                        base["recompute_packing"] = dict(planned.plan.meta["recompute_packing"])
                names, weights = tuple(t.name for t in self.cfg.tasks), tuple(t.weight for t in self.cfg.tasks)
                tasks = step_tasks(planned.plan, docs, self.step_no, modes, names, weights)
            results, failure, moved, dispatch_ms = self._dispatch(tasks, planned, n, attempt, t_dispatch)
            if failure is None:
                outcomes = [results[w] for w in self.workers.worker_ids]
                break
            oom = None
            if failure.out_of_memory:  # the same batch is planned again, for less memory per worker
                self.profile, oom, message = lowered_after_oom(self.profile, failure.out_of_memory, self.step_no)
                self._budget_cap = self.profile.memory_budget_bytes
                self.planner.set_profile(self.profile)
                self._publish({"event": "planner", "message": message})
            try:
                rec = self.elastic.recover(failure, attempt, f"run step {self.step_no}")
            except PartsLostError as e:  # stage-local parameters whose every holder died: back to the checkpoint
                self._rolled_back = carried  # an earlier roll-back is still recorded with the next trained step
                return self._roll_back(e, f"run step {self.step_no}", recoveries[len(carried) :])
            if oom is not None:
                rec["out_of_memory"] = oom
            recoveries.append(rec)
            rerun_from = time.perf_counter()  # the recovered step runs again (or stands) from here
            attempt = rec["attempt"] + 1
            if rec["step_completed"]:  # some survivors finished the update before the failure: it stands
                outcomes = [results.get(w) if w in failure.completed else None for w in base["worker_ids"]]
                break
        self.stream.next_batch()
        t_done = time.perf_counter()
        if attempt:  # the time a user lived: detect (last sign of life -> failure seen), re-form, re-run
            rec = recoveries[-1]
            rec["rerun_ms"] = (t_done - rerun_from) * 1e3
            rec["total_ms"] = rec.get("detect_ms", 0.0) + rec["recovery_ms"] + rec["rerun_ms"]
        tokens = next(o for o in outcomes if o is not None).num_predicted
        want = sum(d.predicted for d in docs)  # loss-target tokens of the batch (text: sum of length - 1)
        if tokens != want:
            raise RuntimeError(f"step {self.step_no}: the workers trained {tokens} target tokens, the batch has {want}")
        measured_ms = (t_done - t_dispatch) * 1e3
        self._last_step_ms = measured_ms
        priced_by = self._priced_by(planned)
        record = step_record(
            base, planned, priced_by, outcomes, measured_ms, dispatch_ms, self._level(planned, priced_by)
        )
        if mixed is not None:
            record["sources"] = mixed
        if self.cfg.tasks:
            record["tasks"] = task_fields(self.cfg.tasks, docs, record.get("task_losses", {}), task_epochs)
            record["multitask"] = multitask_fields(planned.plan)
        if not planned.pipelined:
            record["model_state"] = model_state_fields(self.cfg, n)
            self._refit(record, priced_by)
        if moved is not None:
            record["pipeline"]["params"] = {"placement": self.cfg.pipeline.params, **moved}
        self.step_no += 1
        record["overhead_ms"] = (time.perf_counter() - t_done) * 1e3
        record = self._finish(record, t_start, planned.plan)
        return Transition(Ran.TRAINED, step_no, self.step_no, record, tuple(recoveries[len(carried) :]))

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

    def _level(self, planned, priced_by: Profile) -> float:
        """The step level of the run's steps before this one (``solver.step_level``) that this SP step's prices are
        multiplied by; 1.0 without refits (``[plan] refit = 'off'``: the profile as given) and for
        pipelined steps."""
        if not self.cfg.plan.refits or planned.pipelined:
            return 1.0
        return self._refits.level(priced_by)

    def _priced_by(self, planned) -> Profile:
        """The profile that planned and priced ``planned`` (its ``profile_revision``): the record's timeline and the
        refit's verdict use the same price as its ``predicted_ms``."""
        self._priced[self.profile.revision] = self.profile
        return self._priced.get(planned.profile_revision, self.profile)

    def _start_revision(self, profile: Profile, resumed: bool) -> Profile:
        """The profile this start plans with: revision 0 of a fresh run (``profile_revisions.jsonl`` begins anew);
        a resumed or restarted run goes on counting after the file's last revision, so that a record's
        ``profile_revision`` names one profile."""
        path = self.run_dir / "profile_revisions.jsonl"
        if not resumed or not path.exists():
            path.unlink(missing_ok=True)
            return profile
        last = max((json.loads(line)["revision"] for line in path.read_text().splitlines() if line.strip()), default=0)
        profile = dataclasses.replace(profile, revision=last + 1)
        self._log_revision(profile, f"resumed at step {self.step_no}")
        return profile

    def _log_revision(self, profile: Profile, why: str) -> None:
        """Append ``profile`` to ``profile_revisions.jsonl``: every revision a record may name, and why it came."""
        entry = {"revision": profile.revision, "after_step": self.step_no, "why": why}
        with open(self.run_dir / "profile_revisions.jsonl", "a") as f:
            f.write(json.dumps({**entry, "profile": json.loads(profile.to_json())}) + "\n")

    def _apply(self, changes) -> None:
        """Execute the refit loop's decisions (``control.refitting.Change``): plan with a new profile revision from
        the next solve on, and say what happened in one line each."""
        for change in changes:
            if change.profile is not None:
                self.profile = change.profile
                self._priced = {r: p for r, p in self._priced.items() if r >= self.profile.revision - 3}
                self._priced[self.profile.revision] = self.profile
                self.planner.set_profile(self.profile)
                (self.run_dir / "profile_refit.json").write_text(self.profile.to_json())
                self._log_revision(self.profile, change.message)
            if change.message:
                self._publish({"event": "planner", "message": change.message})

    def _refit(self, record: dict, priced_by: Profile) -> None:
        """Hand a trained record to the run's refit (``control.refitting``: every ``plan.refit_every`` steps a refit
        of the time terms in a thread beside the next step, then a trial on the steps planned with it)."""
        if self.cfg.plan.refits:
            self._apply(self._refits.after_step(record, self.step_no, self.profile, priced_by))

    def settle_refit(self, wait: bool = True) -> None:
        """Take up a refit that has finished (``wait``: wait for one in flight): on trial when it predicts its window
        better; the console says what it did."""
        self._apply(self._refits.settle(self.profile, wait))

    def _plan_budget(self) -> float:
        """Seconds the next plan may take (``[plan] budget``): a share of the last measured step on GPU workers."""
        return self.cfg.plan.budget_for(self._last_step_ms, use_gpu=self.cfg.use_gpu)

    def _task_of(self, batch) -> dict:
        """``{"task_of": [...]}`` (each document's task) for the planner in a run of ``[[tasks]]``; {} otherwise (a
        run of one task plans without it)."""
        if not self.cfg.tasks:
            return {}
        return {"task_of": [int(x) for x in self.corpus.task_of[list(batch.doc_ids)]]}

    def _dispatch(self, tasks, planned, n: int, attempt: int, t_dispatch: float):
        """Move stage-local parameters where the step needs them, start every rank's part, plan the next batch
        meanwhile and wait: (results, failure or None, what moved or None, ms until every rank was started)."""
        moved = None
        if isinstance(tasks[0], PipelineTask) and tasks[0].stage_params:
            try:
                moved = self.workers.place_params(tasks[0].held_parts())
            except MembershipFailure as e:  # a worker died while parameters moved: nobody has run the step
                return {}, dataclasses.replace(e.failure, completed=frozenset()), None, 0.0
        block_refs = [{b: self.corpus.shards[b] for b in sorted(t.blocks())} for t in tasks]  # specs, not tokens
        refs = self.workers.run_step(tasks, block_refs)
        dispatch_ms = (time.perf_counter() - t_dispatch) * 1e3
        if self.step_no + 1 < self.cfg.steps and attempt == 0:  # plan the next batch while this one runs
            nxt = self.stream.peek_after()
            budget = self._plan_budget()  # with GPU workers, a share of the step this solve overlaps
            nxt_lengths = [int(x) for x in self.corpus.lengths[list(nxt.doc_ids)]]
            self.planner.plan_ahead(nxt.step, nxt_lengths, n, budget, **self._task_of(nxt))
        # a backstop only: a dead worker fails at once, a stuck collective fails on the worker after its timeout
        waits = 2 * len(planned.plan.plan.units) if planned.pipelined else len(planned.plan.micro_batches)
        results, failure = self.workers.settle(refs, self.cfg.elastic.collective_timeout_s * (waits + 2))
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
        self.trackers.rewind(self.step_no)
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
        self.trackers.log_step(record)
        self.metrics.on_step(record, plan, self.profile)
        self._fallbacks.watch(record)
        for rec in record["recoveries"]:
            self.metrics.on_recovery(rec)
        self._step_wall.append(time.perf_counter() - t_start)
        if self.cfg.checkpoint_every and self.step_no % self.cfg.checkpoint_every == 0 and not self.finished:
            self.checkpoint()
        remaining = self.cfg.steps - self.step_no
        recent = self._step_wall[-10:]
        self._publish({"event": "step", **record, "eta_s": remaining * sum(recent) / len(recent)})
        return record

    # ---------------------------------------------------------------- checkpoints, loop, events
    def request_stop(self, reason: str) -> None:
        """Stop after the step in flight (a signal: SIGTERM from ``ray job stop`` or a preemption, SIGINT from
        Ctrl-C): :meth:`run` then writes a checkpoint and returns with ``stopped`` set."""
        if self._stop_reason is None:
            self._stop_reason = reason
            self._publish(
                {
                    "event": "progress",
                    "message": f"{reason}: stopping after step {self.step_no + 1} (the one in "
                    "flight), then writing a checkpoint",
                }
            )

    def checkpoint(self) -> str:
        """Write this run's checkpoint after :attr:`step_no` steps (model state assembled from the workers)."""
        driver_state = {
            "stream": self.stream.state_dict(),
            "skipped_batches": self.skipped_batches,
            "config": self.cfg.to_dict(),
        }
        if getattr(self.workers, "sharded", False):  # every worker writes its own shard
            path = self.checkpoints.save(self.step_no, None, driver_state, write_shards=self.workers.save_sharded)
        else:
            path = self.checkpoints.save(self.step_no, self.workers.get_state(0), driver_state)
        self._checkpointed_at = self.step_no
        self._last_checkpoint = path
        self._publish({"event": "checkpoint", "step": self.step_no, "path": path})
        return path

    def run(self) -> dict:
        """Step until ``steps`` are done, checkpoint at the end; errors are published, then raised."""
        try:
            if self.workers is None:
                self.setup()
            while not self.finished and self._stop_reason is None:
                self.step()  # a roll-back goes back to the checkpoint's step: the loop trains it again
            # a stop right after a periodic checkpoint keeps that one
            path = self._last_checkpoint if self._checkpointed_at == self.step_no else self.checkpoint()
            summary = {
                "event": "done",
                "steps": self.step_no,
                "skipped_batches": self.skipped_batches,
                "checkpoint": path,
                "records": str(self.records.path),
                "stopped": self._stop_reason,
            }
            self._publish(summary)
            return summary
        except Exception as e:
            if self._closing:  # shutdown() took the workers away under the loop: that is not the run's error
                self._publish({"event": "stopped", "step": self.step_no})
                return {"event": "stopped", "steps": self.step_no, "stopped": self._stop_reason or "shutdown"}
            err = self._keep_work(e) if self.planner is not None else e  # set up: the loop had begun
            self._error = f"{type(err).__name__}: {err}"
            self._publish({"event": "error", "error": self._error})
            if err is e:
                raise
            raise err from e
        finally:
            if self.trackers is not None:  # after the error event: a failed run is marked failed in its trackers
                self.trackers.close(failed=self._error is not None)
            self.events.done = True

    def _keep_work(self, e: Exception) -> Exception:
        """The run stops on ``e``: write a checkpoint of the state after the last completed step from the members
        that hold it (``control.emergency``); the error to raise says where it is, or why there is none."""
        hint = self.checkpoints.hint()  # what the error says about checkpoints (ElasticError appends it)
        resume = f"go on with `flexorch train --config {self.run_dir}/config.json --resume`"
        path, note = save_after_error(
            self.workers,
            self.step_no,
            checkpointed_at=self._checkpointed_at,
            last_checkpoint=self._last_checkpoint,
            save=self.checkpoint,
            resume=resume,
        )
        if path is not None:
            self._publish({"event": "emergency_checkpoint", "step": self.step_no, "path": path})
        text = str(e)
        text = text.replace(hint, note) if hint in text else f"{text.rstrip('. ')}. {note}"
        try:
            return type(e)(text)
        except Exception:  # noqa: BLE001 - an exception class that takes other arguments
            return RuntimeError(text)

    def poll(self, since: int) -> tuple[list[dict], bool]:
        """Events after index ``since`` and whether the run has ended (the CLI polls the driver actor)."""
        return self.events.poll(since)

    def replica_parameters(self) -> list:
        """Every rank's parameters (tests check the replicas are identical and match the reference)."""
        return self.workers.call("parameters_digest")

    def shutdown(self) -> None:
        """Stop the workers and the planner. Called while :meth:`run` is still going (a second Ctrl-C, the CLI
        failing), the loop is told to stop and whatever then fails in it is not reported as the run's error."""
        if not self.events.done:
            self._closing = True
            self._stop_reason = self._stop_reason or "shutdown"
        self._refits.close()
        if getattr(self, "elastic", None) is not None:  # the drain watch's thread
            self.elastic.close()
        if self._capacity is not None:
            self._capacity.close()
        if self.trackers is not None:
            self.trackers.close()
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
        if self.planner is not None:
            self.planner.close()
            self.planner = None


TrainingDriverActor = ray.remote(num_cpus=0, max_concurrency=4)(TrainingDriver)
"""The driver as a Ray actor; ``run`` in one thread while the CLI calls ``poll`` from another."""


def _capacity(cfg: TrainConfig, worker_group, request) -> CapacityRequest | None:
    """The run's :class:`~flexorch.control.capacity.CapacityRequest`, or None when ``[elastic] request_capacity``
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
