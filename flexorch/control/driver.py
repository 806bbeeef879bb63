"""The TrainingDriver: owns the data stream, the step loop, the planner and the workers (DESIGN.md §1).

Every step: (1) take the next global batch from the stream (lengths are known before any token moves); (2) get
its plan, which the planner actor computed while the previous step ran; (3) send each worker its
:class:`~flexorch.tasks.step.StepTask` and the refs of the token blocks its documents live in (tokens go from the
object store to the workers, never through the driver); (4) ask the planner for the next batch's plan, so the
solve overlaps this step; (5) wait for the outcomes, record plan and outcome in ``steps.jsonl``, checkpoint when
due. :meth:`TrainingDriver.step` is one explicit transition, so tests can step the driver and look at its state;
:meth:`run` loops it and publishes progress events the CLI polls.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from flexorch.config import ConfigError, TrainConfig, config_from_dict
from flexorch.control.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from flexorch.control.elastic import Elastic, ElasticError
from flexorch.control.membership import ElasticPolicy
from flexorch.control.planner_client import StepPlannerActor
from flexorch.control.worker_group import MembershipFailure, RayWorkerGroup
from flexorch.data.corpus import load_corpus
from flexorch.data.stream import DocumentStream
from flexorch.records.metrics import RunMetrics
from flexorch.records.writer import StepRecords, skip_record, step_record
from flexorch.solver.errors import InfeasibleBatchError
from flexorch.solver.planner import PlannerConfig
from flexorch.solver.step_planner import PlannedStep, heuristic_plan, planner_profile
from flexorch.tasks.pipeline import PipelineTask, pipeline_tasks
from flexorch.tasks.placement import PartsLostError
from flexorch.tasks.step import step_tasks

__all__ = ["TrainingDriver", "TrainingDriverActor"]


class TrainingDriver:
    """The control plane of one run. Construct, :meth:`setup`, then :meth:`step` or :meth:`run`."""

    def __init__(self, config: dict | TrainConfig, corpus=None):
        self.corpus = corpus  # a loaded Corpus may be shared by in-process drivers (tests, benchmarks)
        self.cfg = config if isinstance(config, TrainConfig) else config_from_dict(config)
        self.run_dir = Path(self.cfg.run_dir)
        self.step_no = 0
        self.skipped_batches = 0
        self.resumed_from: int | None = None
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._pending: tuple[int, int, ray.ObjectRef] | None = None  # (step, world size, plan ref)
        self._done = False
        self._error: str | None = None
        self._step_wall: list[float] = []
        self._rolled_back: list[dict] = []  # a roll-back to the last checkpoint, recorded with the next step
        self._own_checkpoint = None  # the newest checkpoint this run wrote or resumed from (never an older run's)
        self.workers: RayWorkerGroup | None = None

    # ---------------------------------------------------------------- setup
    def setup(self) -> dict:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.corpus is None:
            self.corpus = load_corpus(cfg.data)
        if self.corpus.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"tokenizer {self.corpus.tokenizer_name!r} has {self.corpus.vocab_size} ids but model.vocab_size="
                f"{cfg.model.vocab_size}; raise model.vocab_size to at least {self.corpus.vocab_size}"
            )
        self.stream = DocumentStream(self.corpus.num_docs, cfg.batch_size, cfg.seed)
        ckpt = latest_checkpoint(self.run_dir) if cfg.resume else None
        if cfg.resume and ckpt is None:
            raise ConfigError(f"--resume: no checkpoint in {self.run_dir / 'checkpoints'}; run without --resume")
        self.workers = RayWorkerGroup.from_config(cfg)
        policy = ElasticPolicy(cfg.min_workers, cfg.max_workers, cfg.elastic.wait_s, cfg.elastic.max_attempts)
        self.elastic = Elastic(self.workers, policy, self._publish, self._checkpoint_hint)
        t_world = time.perf_counter()
        try:
            self.workers.form_world()
        except MembershipFailure as e:
            self.elastic.recover(e.failure, 0, "form the first world")
        world_s = time.perf_counter() - t_world
        if ckpt is not None:
            self._own_checkpoint = ckpt
            state, dstate = load_checkpoint(ckpt)
            if dstate["corpus"] != self._corpus_fingerprint():
                raise ConfigError(
                    f"--resume: the checkpoint was taken on another corpus ({dstate['corpus']}); this run reads "
                    f"{self._corpus_fingerprint()}"
                )
            self.stream.load_state_dict(dstate["stream"])
            self.step_no = self.resumed_from = int(dstate["step"])
            self.skipped_batches = int(dstate.get("skipped_batches", 0))
            self.workers.set_state(state)
        self.profile = self._resolve_profile()
        planner_cfg = PlannerConfig(time_limit_s=cfg.plan.time_limit_s, kinds=tuple(cfg.plan.kinds))
        self._planner_args = (
            self.profile,
            planner_cfg,
            cfg.plan.static,
            0 if cfg.use_gpu else 10,
            cfg.pipeline.stages,
            cfg.pipeline.params,
        )
        self.planner = self._start_planner()
        self.records = StepRecords(self.run_dir, keep_before_step=self.step_no if ckpt is not None else None)
        self.metrics = RunMetrics(self.run_dir.name)
        (self.run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1, default=list))
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
            "resumed_from": self.resumed_from,
            "steps": cfg.steps,
            "model_params": cfg.model.num_params(),
            "pipeline_stages": cfg.pipeline.stages,
        }
        self._publish(summary)
        return summary

    def _corpus_fingerprint(self) -> dict:
        c = self.corpus
        return {"num_docs": c.num_docs, "tokens": int(c.lengths.sum()), "first": c.keys[0], "last": c.keys[-1]}

    def _resolve_profile(self):
        from flexorch.control.calibration import resolve_profile

        base = resolve_profile(self.cfg, self.workers, self.run_dir, self._publish)
        stage_bytes = None
        if self.cfg.pipelined:  # what a stage holds, measured on a worker's own model (a fraction of a second)
            stage_bytes = ray.get(self.workers.actor(self.workers.worker_ids[0]).stage_activation_bytes.remote())
        return planner_profile(
            base,
            num_heads=self.cfg.model.num_heads,
            num_kv_heads=self.cfg.model.num_kv_heads,
            tokens_per_worker=self.cfg.plan.tokens_per_worker,
            num_layers=self.cfg.model.num_layers,
            vocab_size=self.cfg.model.vocab_size,
            stage_bytes=stage_bytes,
        )

    # ---------------------------------------------------------------- one step
    @property
    def finished(self) -> bool:
        return self.step_no >= self.cfg.steps

    def step(self) -> dict:
        """Train one global batch (or record it as skipped); returns its record.

        Membership changes between steps (workers that finished starting join here). When an attempt fails
        because workers died or hung, the elastic policy decides; on a shrink the same batch is re-planned for
        the survivors and re-run, so no document is lost or trained twice (DESIGN.md §4)."""
        if self.workers is None:
            raise RuntimeError("call setup() first")
        t_start = time.perf_counter()
        try:
            joined = self.elastic.at_boundary()
        except PartsLostError as e:
            self._roll_back(e, "admit joining workers")
            return self.step()
        batch = self.stream.peek()  # taken (next_batch) only once the step is done or skipped
        lengths = [int(x) for x in self.corpus.lengths[list(batch.doc_ids)]]
        recoveries, self._rolled_back = self._rolled_back + ([joined] if joined else []), []
        attempt = 0
        while True:
            n = self.workers.size
            t_wait = time.perf_counter()
            planned = self._plan(batch.step, lengths, n)
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
                "baselines_ms": planned.baselines_ms,
                "recoveries": recoveries,
            }
            if planned.plan is None:
                self.stream.next_batch()
                return self._skip(base, planned)
            t_dispatch = time.perf_counter()
            docs = self.corpus.locate(list(batch.doc_ids))
            if planned.pipelined:
                stage_params = self.cfg.pipeline.params == "stage"
                tasks = pipeline_tasks(
                    planned.plan, docs, self.step_no, stage_params=stage_params, tied=self.cfg.model.tie_embeddings
                )
            else:
                tasks = step_tasks(planned.plan, docs, self.step_no)
            results, failure, moved, dispatch_ms = self._dispatch(tasks, planned, n, attempt, t_dispatch)
            if failure is None:
                outcomes = [results[w] for w in self.workers.worker_ids]
                break
            try:
                rec = self.elastic.recover(failure, attempt, f"run step {self.step_no}")
            except PartsLostError as e:  # stage-local parameters whose every holder died: back to the checkpoint
                self._roll_back(e, f"run step {self.step_no}")
                return self.step()
            recoveries.append(rec)
            attempt = rec["attempt"] + 1
            if rec["step_completed"]:  # some survivors finished the update before the failure: it stands
                outcomes = [results.get(w) if w in failure.completed else None for w in base["worker_ids"]]
                break
        self.stream.next_batch()
        t_done = time.perf_counter()
        tokens = next(o for o in outcomes if o is not None).num_predicted
        if tokens != sum(s - 1 for s in lengths):
            raise RuntimeError(f"step {self.step_no}: the workers trained {tokens} tokens, the batch has more")
        measured_ms = (t_done - t_dispatch) * 1e3
        record = step_record(base, planned, self.profile, outcomes, measured_ms, dispatch_ms)
        if moved is not None:
            record["pipeline"]["params"] = {"placement": self.cfg.pipeline.params, **moved}
        self.step_no += 1
        record["overhead_ms"] = (time.perf_counter() - t_done) * 1e3
        return self._finish(record, t_start, planned.plan)

    def _dispatch(self, tasks, planned, n: int, attempt: int, t_dispatch: float):
        """Move stage-local parameters where the step needs them, start every rank's part, plan the next batch
        meanwhile and wait: (results, failure or None, what moved or None, ms until every rank was started)."""
        moved = None
        if isinstance(tasks[0], PipelineTask) and tasks[0].stage_params:
            try:
                moved = self.workers.place_params(tasks[0].held_parts())
            except MembershipFailure as e:  # a worker died while parameters moved: nobody has run the step
                return {}, dataclasses.replace(e.failure, completed=frozenset()), None, 0.0
        block_refs = [{b: self.corpus.block_refs[b] for b in sorted(t.blocks())} for t in tasks]
        refs = self.workers.run_step(tasks, block_refs)
        dispatch_ms = (time.perf_counter() - t_dispatch) * 1e3
        if self.step_no + 1 < self.cfg.steps and attempt == 0:  # plan the next batch while this one runs
            self._plan_ahead(n)
        # a backstop only: a dead worker fails at once, a stuck collective fails on the worker after its timeout
        waits = 2 * len(planned.plan.plan.units) if planned.pipelined else len(planned.plan.micro_batches)
        results, failure = self.workers.settle(refs, self.cfg.elastic.collective_timeout_s * (waits + 2))
        return results, failure, moved, dispatch_ms

    def _roll_back(self, err: PartsLostError, what: str) -> None:
        """Every holder of some parameters was lost (stage-local parameters): load the last checkpoint on the
        workers alive and continue from its step; the steps after it are trained again on the same batches, and
        their records are rewritten. Without a checkpoint the run stops with what to do."""
        ckpt = self._own_checkpoint
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
        self._pending = None
        rec = {
            "what": what,
            "rollback": True,
            "lost": sorted(err.lost_workers),
            "reason": str(err),
            "from_step": from_step,
            "to_step": self.step_no,
            "world_before": list(self.workers.worker_ids),
            "world_after": list(self.workers.worker_ids),
            "recovery_ms": (time.perf_counter() - t0) * 1e3,
        }
        self._rolled_back.append(rec)
        self._publish({"event": "membership", **rec})

    def _start_planner(self):
        """The planner actor, beside the driver (it survives the loss of a worker node); niceness 10 on CPU."""
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        return StepPlannerActor.options(scheduling_strategy=here).remote(*self._planner_args)

    def _plan(self, stream_step: int, lengths: list[int], n: int) -> PlannedStep:
        """The plan of this batch for ``n`` workers: the one solved during the last step if it was for ``n``.

        A plan not back within ``plan.timeout_s`` (CBC can get stuck on rare models) is abandoned: the planner
        actor is replaced and this step runs the BatchAda heuristic plan (status 'fallback')."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[:2] == (stream_step, n):
            ref = pending[2]
        else:
            ref = self.planner.plan.remote(lengths, n)
        try:
            return ray.get(ref, timeout=self.cfg.plan.timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(self.planner, no_restart=True)
            self.planner = self._start_planner()
            self._publish(
                {
                    "event": "planner",
                    "message": f"step {self.step_no}: the planner gave no plan within plan.timeout_s="
                    f"{self.cfg.plan.timeout_s:g} s; restarted it, this step runs the BatchAda heuristic plan",
                }
            )
            return heuristic_plan(
                self.profile, lengths, n, self.cfg.plan.static, self.cfg.pipeline.stages, self.cfg.pipeline.params
            )

    def _plan_ahead(self, n: int) -> None:
        nxt = self._peek_after()
        if nxt is not None:
            nxt_lengths = [int(x) for x in self.corpus.lengths[list(nxt.doc_ids)]]
            self._pending = (nxt.step, n, self.planner.plan.remote(nxt_lengths, n))

    def _peek_after(self):
        """The batch after the current one (the stream advances only when a step is done)."""
        state = self.stream.state_dict()
        self.stream.next_batch()
        nxt = self.stream.peek()
        self.stream.load_state_dict(state)
        return nxt

    def _checkpoint_hint(self) -> str:
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            return "No checkpoint was written yet (set checkpoint_every to keep one)"
        return f"The last checkpoint, {ckpt.path}, is intact: run again with --resume when capacity is back"

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
        record = self.records.append(record)
        self.metrics.on_step(record, plan, self.profile)
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
    def checkpoint(self) -> str:
        state = self.workers.get_state(0)
        driver_state = {
            "stream": self.stream.state_dict(),
            "corpus": self._corpus_fingerprint(),
            "skipped_batches": self.skipped_batches,
            "config": self.cfg.to_dict(),
        }
        ckpt = save_checkpoint(self.run_dir, self.step_no, state, driver_state, keep=self.cfg.keep_checkpoints)
        self._own_checkpoint = ckpt
        self._publish({"event": "checkpoint", "step": self.step_no, "path": ckpt.path})
        return ckpt.path

    def run(self) -> dict:
        """Step until ``steps`` are done, checkpoint at the end; errors are published, then raised."""
        try:
            if self.workers is None:
                self.setup()
            while not self.finished:
                self.step()
            path = self.checkpoint()
            summary = {
                "event": "done",
                "steps": self.step_no,
                "skipped_batches": self.skipped_batches,
                "checkpoint": path,
                "records": str(self.records.path),
            }
            self._publish(summary)
            return summary
        except Exception as e:
            self._error = f"{type(e).__name__}: {e}"
            self._publish({"event": "error", "error": self._error})
            raise
        finally:
            self._done = True

    def _publish(self, event: dict) -> None:
        with self._lock:
            self._events.append(event)

    def poll(self, since: int) -> tuple[list[dict], bool]:
        """Events after index ``since`` and whether the run has ended."""
        with self._lock:
            return self._events[since:], self._done

    def replica_parameters(self) -> list:
        """Every rank's parameters (tests check the replicas are identical and match the reference)."""
        return self.workers.call("parameters_digest")

    def shutdown(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
        planner = getattr(self, "planner", None)
        if planner is not None:
            ray.kill(planner)
            self.planner = None


TrainingDriverActor = ray.remote(num_cpus=0, max_concurrency=4)(TrainingDriver)
"""The driver as a Ray actor; ``run`` in one thread while the CLI calls ``poll`` from another."""
