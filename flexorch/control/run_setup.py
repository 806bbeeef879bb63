"""A run's start (``TrainingDriver.setup``): read the data, start the workers and form the first world, resume from a
checkpoint when asked, find the profile to plan with, and start the planner, the records and the trackers.

:class:`RunStart` is given what the driver was constructed with and builds the run's parts; it returns them as one
typed value, :class:`RunParts`, which the driver takes and owns from then on. Nothing here reads or sets the
driver's attributes.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray

from flexorch.config import ConfigError, TrainConfig
from flexorch.config.sharding import uneven_world_note
from flexorch.control.calibration import model_state_fields, run_profile
from flexorch.control.checkpoint_store import CheckpointStore
from flexorch.control.elastic import Elastic
from flexorch.control.failures import MembershipFailure
from flexorch.control.group import WorkerGroup
from flexorch.control.host_load import niced_on_busy_node
from flexorch.control.membership import ElasticPolicy
from flexorch.control.memory_budget import resolve_device_budget
from flexorch.control.planner_client import PlannerFactory, PlannerSpec
from flexorch.control.profile_revisions import ProfileRevisions
from flexorch.control.recompute_choice import with_recompute_ratios
from flexorch.control.run_checkpoints import RunCheckpoints
from flexorch.control.speed_watch import SpeedWatch
from flexorch.control.step_callbacks import StepCallback, step_callbacks
from flexorch.control.step_plans import StepPlans
from flexorch.control.worker_group import RayWorkerGroup
from flexorch.data.bpe import prepare_tokenizer
from flexorch.data.corpus import load_corpus
from flexorch.data.mixture import load_mixture, mixture_tokenizer
from flexorch.data.run_stream import open_stream
from flexorch.data.task_corpus import load_task_corpus, tasks_tokenizer
from flexorch.records.metrics import RunMetrics
from flexorch.records.trackers import Trackers
from flexorch.records.writer import StepRecords

__all__ = ["RunParts", "RunStart", "where_it_runs"]


@dataclass(kw_only=True)
class RunParts:
    """What a run's start built, each part the driver's to own: the config as resolved (a tokenizer trained here,
    ``tokens_per_worker = 'auto'``), the corpus and its batch stream, the workers and their elastic executor, the
    checkpoint store, the step plans, the planner client and the workers' speeds (``control.speed_watch``), the
    records, metrics and trackers, the callbacks beside every step; where a resumed run starts (``resumed_from``,
    ``skipped_batches``) and the ``setup`` event published. A start that fails part way leaves the parts after the
    failing one None: the driver takes those it has (what the failure concerned, and what its shutdown closes)."""

    cfg: TrainConfig
    corpus: object = None
    stream: object = None
    workers: WorkerGroup | None = None
    elastic: Elastic | None = None
    checkpoints: RunCheckpoints | None = None
    plans: StepPlans | None = None
    planner: object = None
    speeds: SpeedWatch | None = None
    records: StepRecords | None = None
    metrics: RunMetrics | None = None
    trackers: Trackers | None = None
    callbacks: list[StepCallback] = field(default_factory=list)
    resumed_from: int | None = None
    skipped_batches: int = 0
    summary: dict | None = None


class RunStart:
    """Builds a run's parts (:meth:`build`, into :attr:`parts` as each is made) from what the driver was constructed
    with: ``corpus`` and ``workers`` when given (None: read ``data``, start Ray workers), ``capacity``
    (``control.capacity``), the planner client factory, the profile ``revisions`` to start, ``publish`` for events;
    and what the step callbacks are given (``control.step_callbacks``): the ``fallbacks`` watch, ``save`` (writes a
    checkpoint), ``started`` (when the step being recorded began)."""

    def __init__(
        self,
        cfg: TrainConfig,
        publish: Callable[[dict], None],
        *,
        corpus,
        workers: WorkerGroup | None,
        capacity,
        planner_factory: PlannerFactory,
        revisions: ProfileRevisions,
        fallbacks: StepCallback,
        save: Callable[[], str],
        started: Callable[[], float],
    ):
        self.parts = RunParts(cfg=cfg, corpus=corpus)
        self._publish = publish
        self.run_dir = Path(cfg.run_dir)
        self._given_workers, self._capacity = workers, capacity
        self._planner_factory, self.revisions = planner_factory, revisions
        self._fallbacks, self._save, self._started = fallbacks, save, started

    def build(self) -> RunParts:
        """Read the data, start the workers and form the first world, resume from a checkpoint when asked, find the
        profile to plan with and start the planner, records, speed watch and trackers; publishes the ``setup``
        event."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        note = niced_on_busy_node()
        if note:
            self._publish({"event": "planner", "message": note})
        parts = self.parts
        corpus, stream = self._open_data()
        cfg = parts.cfg
        sharded = cfg.sharding_mode != "replicate"
        store = CheckpointStore.of_run(self.run_dir, cfg.checkpoint.storage)
        store.check_writable()  # a bucket that is not there, or no credentials: an error before any worker starts
        parts.checkpoints = RunCheckpoints(
            store, corpus, cfg.keep_checkpoints, sharded, keep_every=cfg.checkpoint.keep_every, run_dir=self.run_dir
        )
        resumed = parts.checkpoints.resume() if cfg.resume else None  # checked before any worker starts
        for message in parts.checkpoints.skipped:  # newer damaged or partial checkpoints the resume passed over
            self._publish({"event": "checkpoint_skipped", "message": message})
        world_s = self._start_workers(corpus, parts.checkpoints)
        if resumed is not None:
            state, dstate = resumed
            stream.load_state_dict(dstate["stream"])
            parts.resumed_from, parts.skipped_batches = int(dstate["step"]), int(dstate.get("skipped_batches", 0))
            parts.workers.set_state(state)
        parts.planner = self._start_planner(parts.workers, parts.resumed_from)
        parts.records = StepRecords(self.run_dir, keep_before_step=parts.resumed_from)
        parts.metrics = RunMetrics(self.run_dir.name)
        cfg = parts.cfg
        parts.speeds = SpeedWatch.for_run(cfg, parts.workers, self._publish, parts.metrics)
        parts.plans.use(cfg, parts.planner, parts.speeds)
        (self.run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1, default=list))
        parts.trackers = Trackers.open(cfg.tracking, self.run_dir, cfg.to_dict(), parts.resumed_from, say=self._say)
        profile_of = lambda: self.revisions.profile  # noqa: E731 - the profile the run plans with now
        parts.callbacks = step_callbacks(
            cfg, parts.trackers, parts.metrics, self._fallbacks, profile_of=profile_of, save=self._save,
            publish=self._publish, started=self._started,
        )  # fmt: skip
        parts.summary = self._setup_summary(parts, world_s)
        self._publish(parts.summary)
        return parts

    def _say(self, message: str) -> None:
        self._publish({"event": "progress", "message": message})

    def _start_planner(self, workers: WorkerGroup, resumed_from: int | None):
        """Resolve the device budget (``tokens_per_worker = 'auto'``), find the profile to plan with and start the
        planner client with it; the config becomes the resolved one."""
        parts = self.parts
        parts.cfg, budget = resolve_device_budget(parts.cfg, workers, self._publish)  # tokens_per_worker = 'auto'
        cfg = parts.cfg
        act_budget = budget.activation_bytes if budget is not None else None
        profile = run_profile(cfg, workers, self.run_dir, self._publish, act_budget)
        profile = with_recompute_ratios(cfg, workers, profile, self._say)  # 'auto' recompute's terms
        self.revisions.start(profile, resumed_from is not None, resumed_from or 0)
        planner = self._planner_factory(PlannerSpec.for_run(cfg, self.revisions.profile), self._publish)
        self.revisions.attach(planner)
        return planner

    def _open_data(self) -> tuple:
        """(the run's corpus (read here unless given), its batch stream); ``[data]`` tokenizers trained here
        ('bpe:N') become the config's. Raises ConfigError when the tokenizer's ids do not fit the model."""
        parts = self.parts
        cfg = parts.cfg
        if parts.corpus is None and cfg.tasks:  # [[tasks]]: each task's data, one id space (data.task_corpus)
            parts.cfg = cfg = tasks_tokenizer(cfg, self.run_dir)
            parts.corpus = load_task_corpus(cfg.tasks, publish=self._publish)
        elif parts.corpus is None and cfg.data.sources:  # [[data.sources]]: a mixture, each source its own store
            parts.cfg = cfg = cfg.replace(data=mixture_tokenizer(cfg.data, self.run_dir))
            parts.corpus = load_mixture(cfg.data, publish=self._publish)
        elif parts.corpus is None:  # 'bpe:N' is trained here (or reused) and becomes 'hf:<run_dir>/tokenizer'
            parts.cfg = cfg = cfg.replace(data=prepare_tokenizer(cfg.data, self.run_dir))
            parts.corpus = load_corpus(cfg.data, publish=self._publish)
        if parts.corpus.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"tokenizer {parts.corpus.tokenizer_name!r} has {parts.corpus.vocab_size} ids but model.vocab_size="
                f"{cfg.model.vocab_size}; raise model.vocab_size to at least {parts.corpus.vocab_size}"
            )
        parts.stream = open_stream(cfg, parts.corpus)  # plain, [[data.sources]] or [[tasks]]: one BatchStream
        return parts.corpus, parts.stream

    def _start_workers(self, corpus, checkpoints: RunCheckpoints) -> float:
        """Start the workers (an autoscaled cluster may have to grow first), form the first world and watch for
        drains (a drain seen mid-step starts the smaller world's plan, ``control.step_plans``): the parts' workers,
        elastic executor and step plans; returns the seconds the world took to form."""
        cfg = self.parts.cfg
        if self._capacity is not None and self._given_workers is None:  # an autoscaled cluster may start empty
            key = "GPU" if cfg.use_gpu else "CPU"
            slots = lambda: ray.cluster_resources().get(key, 0)  # noqa: E731
            self._capacity.await_start(cfg.workers, cfg.elastic.wait_s, slots, self._publish)
        self.parts.workers = workers = self._given_workers or RayWorkerGroup.from_config(cfg, publish=self._publish)
        policy = ElasticPolicy(cfg.min_workers, cfg.max_workers, cfg.elastic.wait_s, cfg.elastic.max_attempts)
        mode, shard = cfg.sharding_mode, cfg.sharding.shard_size
        layout = functools.partial(uneven_world_note, mode, shard_size=shard)
        grace = cfg.elastic.sigterm_grace_s
        self.parts.elastic = elastic = Elastic(
            workers, policy, self._publish, checkpoints.hint, layout_note=layout, grace_s=grace
        )
        t_world = time.perf_counter()
        try:
            workers.form_world()
        except MembershipFailure as e:
            elastic.recover(e.failure, 0, "form the first world")
        world_s = time.perf_counter() - t_world
        elastic.reform_s = world_s
        self.parts.plans = plans = StepPlans(corpus, workers)
        elastic.watch_drains(plans.without)  # drains seen within a second; their workers leave between steps
        return world_s

    def _setup_summary(self, parts: RunParts, world_s: float) -> dict:
        """The ``setup`` event: the data, the world, the profile and the model the run starts with."""
        cfg, profile, workers = parts.cfg, self.revisions.profile, parts.workers
        return {
            "event": "setup",
            "corpus": parts.corpus.stats,
            "num_docs": parts.corpus.num_docs,
            "batches_per_epoch": parts.stream.batches_per_epoch,
            "workers": workers.size,
            "min_workers": cfg.min_workers,
            "max_workers": cfg.max_workers,
            "world_s": world_s,
            "profile": profile.name,
            "tokens_per_worker": profile.tokens_per_device,
            "group_tokens_per_worker": cfg.tokens_per_worker,
            "resumed_from": parts.resumed_from,
            "steps": cfg.steps,
            "model_params": cfg.model.num_params(),
            "model_active_params": cfg.model.active_params(),  # MoE: what a token computes with
            "pipeline_stages": cfg.pipeline.stages,
            "sharding": model_state_fields(cfg, workers.size),
            "kernels": {k: workers.call("info")[0].get(k) for k in ("attention", "compiled_layers")},
        }


def where_it_runs() -> dict:
    """Where this process runs (a driver, and its planner beside it): node id, IP, pid."""
    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
    }
