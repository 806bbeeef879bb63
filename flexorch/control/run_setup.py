"""A run's start (``TrainingDriver.setup``): read the data, start the workers and form the first world, resume from a
checkpoint when asked, find the profile to plan with, and start the planner, the records and the trackers.

:class:`RunSetup` is a part of :class:`~flexorch.control.driver.TrainingDriver` (its base class), kept apart so that
each file holds one job: this one the start, ``control.driver`` the step transition, ``control.run_loop`` the loop,
checkpoints and the end. It reads and sets the driver's attributes (``cfg``, ``corpus``, ``stream``, ``workers``,
``elastic``, ``checkpoints``, ``planner``, ``records``, ``metrics``, ``trackers``, ``revisions``, ``step_no``).
"""

from __future__ import annotations

import functools
import json
import os
import time

import ray

from flexorch.config import ConfigError
from flexorch.config.sharding import uneven_world_note
from flexorch.control.calibration import model_state_fields, run_profile
from flexorch.control.checkpoint import RunCheckpoints
from flexorch.control.elastic import Elastic
from flexorch.control.host_load import niced_on_busy_node
from flexorch.control.membership import ElasticPolicy
from flexorch.control.memory_budget import resolve_device_budget
from flexorch.control.planner_client import PlannerSpec
from flexorch.control.recompute_choice import with_recompute_ratios
from flexorch.control.settle import MembershipFailure
from flexorch.control.step_callbacks import step_callbacks
from flexorch.control.worker_group import RayWorkerGroup
from flexorch.data.bpe import prepare_tokenizer
from flexorch.data.corpus import load_corpus
from flexorch.data.mixture import MixtureStream, load_mixture, mixture_tokenizer
from flexorch.data.stream import DocumentStream
from flexorch.data.task_corpus import TaskStreams, load_task_corpus, tasks_tokenizer
from flexorch.records.metrics import RunMetrics
from flexorch.records.trackers import Trackers
from flexorch.records.writer import StepRecords

__all__ = ["RunSetup"]


class RunSetup:
    """The start of a run, as methods of the driver (see the module's docstring)."""

    def setup(self) -> dict:
        """Read the data, start the workers and form the first world, resume from a checkpoint when asked, find the
        profile to plan with and start the planner, records and trackers; returns the summary it published."""
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        note = niced_on_busy_node()
        if note:
            self._publish({"event": "planner", "message": note})
        self._open_data()
        cfg = self.cfg
        sharded = cfg.sharding_mode != "replicate"
        self.checkpoints = RunCheckpoints(self.run_dir, self.corpus, cfg.keep_checkpoints, sharded=sharded)
        resumed = self.checkpoints.resume() if cfg.resume else None  # checked before any worker starts
        for message in self.checkpoints.skipped:  # newer damaged or partial checkpoints the resume passed over
            self._publish({"event": "checkpoint_skipped", "message": message})
        world_s = self._start_workers()
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
        profile = run_profile(cfg, self.workers, self.run_dir, self._publish, act_budget)
        say = lambda message: self._publish({"event": "progress", "message": message})  # noqa: E731
        profile = with_recompute_ratios(cfg, self.workers, profile, say)  # 'auto' recompute's terms
        self.revisions.start(profile, resumed is not None, self.step_no)
        self.planner = self._planner_factory(PlannerSpec.for_run(cfg, self.profile), self._publish)
        self.revisions.attach(self.planner)
        self.records = StepRecords(self.run_dir, keep_before_step=self.step_no if resumed is not None else None)
        self.metrics = RunMetrics(self.run_dir.name)
        (self.run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1, default=list))
        self.trackers = Trackers.open(cfg.tracking, self.run_dir, cfg.to_dict(), self.resumed_from, say=say)
        self.callbacks = step_callbacks(self)
        summary = self._setup_summary(world_s)
        self._publish(summary)
        if self._restart is not None:  # the lost driver's replacement is set up: re-run from its checkpoint now
            self._restart_setup_at = time.time()
            self._restart["recovery_ms"] = (self._restart_setup_at - self._restart.pop("seen_at")) * 1e3
            self._restart["from_step"] = self.step_no
            self._restart["corpus_ms"] = float(self.corpus.stats.get("load_s", 0.0)) * 1e3  # of the new driver's
        return summary

    def _open_data(self) -> None:
        """The run's corpus (read here unless given) and its batch stream; ``[data]`` tokenizers trained here
        ('bpe:N') become the config's. Raises ConfigError when the tokenizer's ids do not fit the model."""
        cfg = self.cfg
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

    def _start_workers(self) -> float:
        """Start the workers (an autoscaled cluster may have to grow first), form the first world and watch for
        drains; returns the seconds the world took to form."""
        cfg = self.cfg
        if self._capacity is not None and self._given_workers is None:  # an autoscaled cluster may start empty
            key = "GPU" if cfg.use_gpu else "CPU"
            slots = lambda: ray.cluster_resources().get(key, 0)  # noqa: E731
            self._capacity.await_start(cfg.workers, cfg.elastic.wait_s, slots, self._publish)
        self.workers = self._given_workers or RayWorkerGroup.from_config(cfg, publish=self._publish)
        policy = ElasticPolicy(cfg.min_workers, cfg.max_workers, cfg.elastic.wait_s, cfg.elastic.max_attempts)
        mode, shard = cfg.sharding_mode, cfg.sharding.shard_size
        layout = functools.partial(uneven_world_note, mode, shard_size=shard)
        grace = self.cfg.elastic.sigterm_grace_s
        self.elastic = Elastic(self.workers, policy, self._publish, self.checkpoints.hint, layout, grace)
        t_world = time.perf_counter()
        try:
            self.workers.form_world()
        except MembershipFailure as e:
            self.elastic.recover(e.failure, 0, "form the first world")
        world_s = time.perf_counter() - t_world
        self.elastic.reform_s = world_s
        self.elastic.watch_drains(self._plan_without)  # drains seen within a second; their workers leave between steps
        return world_s

    def _setup_summary(self, world_s: float) -> dict:
        """The ``setup`` event: the data, the world, the profile and the model the run starts with."""
        cfg = self.cfg
        return {
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

    def where(self) -> dict:
        """Where this driver runs (its planner runs beside it): node id, IP, pid."""

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
        }
