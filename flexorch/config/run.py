"""One training run: the run keys of a run file and its tables, checked against each other on construction.

A run file (see ``examples/train_laptop.toml``) has top-level run keys and nine tables, each a keyword-only
dataclass that checks its own keys (``flexorch.config.<module>``)::

    steps = 20            # run keys (TrainConfig): steps, workers, batch_size, seed, run_dir, checkpoint_every, ...
    [model]               # model.ModelConfig: preset = "tiny" | "small" | "llama-7b", plus any field to override
    [optim]               # optim.OptimConfig: lr, warmup_steps, decay_steps, grad_clip, ...
    [data]                # data.CorpusConfig: source, format, text_field, max_context, over_long, ...
    [plan]                # plan.PlanSettings: mode, profile, tokens_per_worker, time_limit_s, ...
    [elastic]             # elastic.ElasticSettings: min_workers, max_workers, wait_s, max_attempts, ...
    [pipeline]            # pipeline.PipelineSettings: stages, params
    [sharding]            # sharding.ShardingSettings: mode, shard_size, precision, activation_checkpointing
    [tracking]            # tracking.TrackingSettings: tensorboard, mlflow, wandb, run_name, ...
    [checkpoint]          # checkpoint.CheckpointSettings: storage, every, keep, keep_every

:class:`TrainConfig` checks what spans tables (``data.max_context`` against ``workers x plan.tokens_per_worker``, a
static layout or pipeline stages against the model and the workers) and derives the elastic bounds in force.
Command-line flags override the common keys (``flexorch.config.load``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from flexorch.config.checkpoint import CheckpointSettings
from flexorch.config.data import CorpusConfig, bpe_vocab
from flexorch.config.elastic import ElasticSettings
from flexorch.config.errors import ConfigError
from flexorch.config.model import ModelConfig
from flexorch.config.optim import OptimConfig
from flexorch.config.pipeline import PipelineSettings
from flexorch.config.plan import AUTO_CPU_TOKENS, PlanSettings
from flexorch.config.sharding import ShardingSettings
from flexorch.config.tasks import TaskSettings, batch_counts, lora_specs
from flexorch.config.tracking import TrackingSettings
from flexorch.solver.pipeline.stage_count import check_stage_count

__all__ = ["CHECKPOINT_ALIASES", "TABLES", "TrainConfig"]

TABLES = {
    "model": ModelConfig,
    "optim": OptimConfig,
    "data": CorpusConfig,
    "plan": PlanSettings,
    "elastic": ElasticSettings,
    "pipeline": PipelineSettings,
    "sharding": ShardingSettings,
    "tracking": TrackingSettings,
    "checkpoint": CheckpointSettings,
}
"""The tables of a run file by name, each the dataclass of one :class:`TrainConfig` field."""

CHECKPOINT_ALIASES = {"every": "checkpoint_every", "keep": "keep_checkpoints"}
"""``[checkpoint]`` keys and the top-level run keys they are another spelling of."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run."""

    steps: int = 20
    """Total steps of the run (a resumed run counts the steps already done)."""
    workers: int = 4
    """Worker actors at the start. A worker is one device slot (a GPU with ``use_gpu``, else a CPU slot), and
    "workers" is flexorch's one word for it in every flag and key (``flexorch plan --workers``,
    ``plan.tokens_per_worker``, ``elastic.min_workers``); the solver's API calls the same count ``num_devices``."""
    batch_size: int = 16
    """Documents per global batch."""
    seed: int = 0
    """Seeds the model init and the data order."""
    run_dir: str = "runs/train"
    """Where the step records, the profile and the checkpoints go."""
    checkpoint_every: int = 0
    """Checkpoint every this many steps (0: only at the end); also ``[checkpoint] every``."""
    resume: bool = False
    """Continue from the newest checkpoint in the run's checkpoint storage (at the exact next document)."""
    keep_checkpoints: int = 2
    """The newest checkpoints kept (older ones deleted once a newer one verifies); also ``[checkpoint] keep``."""
    worker_threads: int = 1
    """torch threads per CPU worker (one per worker on a shared machine)."""
    use_gpu: bool = False
    """One GPU per worker (NCCL) instead of CPU slots (gloo)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The ``[model]`` table: the decoder's shape."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The ``[optim]`` table: AdamW and the learning-rate schedule."""
    data: CorpusConfig = field(default_factory=CorpusConfig)
    """The ``[data]`` table: the corpus and how it is tokenized."""
    plan: PlanSettings = field(default_factory=PlanSettings)
    """The ``[plan]`` table: how each step is planned."""
    elastic: ElasticSettings = field(default_factory=ElasticSettings)
    """The ``[elastic]`` table: workers leaving and joining mid-run."""
    pipeline: PipelineSettings = field(default_factory=PipelineSettings)
    """The ``[pipeline]`` table: pipeline stages and where their parameters live."""
    sharding: ShardingSettings = field(default_factory=ShardingSettings)
    """The ``[sharding]`` table: model-state sharding (FSDP2), mixed precision, activation checkpointing."""
    tracking: TrackingSettings = field(default_factory=TrackingSettings)
    """The ``[tracking]`` table: TensorBoard, MLflow and Weights & Biases."""
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    """The ``[checkpoint]`` table: where checkpoints are written (a directory or an object store) and which are
    kept."""
    tasks: tuple[TaskSettings, ...] = ()
    """The ``[[tasks]]`` tables (``flexorch.config.tasks``): several fine-tuning tasks over one base model, each with
    its own data, loss weight, batch share and LoRA adapter; empty: one task on ``[data]``."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name in TABLES and not isinstance(getattr(self, f.name), TABLES[f.name]):
                raise ConfigError(
                    f"{f.name} must be {TABLES[f.name].__name__} (the [{f.name}] table of a run file: "
                    f"flexorch.config.config_from_dict reads tables from dicts), got {getattr(self, f.name)!r}"
                )
        for name in ("steps", "workers", "batch_size", "keep_checkpoints", "worker_threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        for name in ("checkpoint_every", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {v!r}")
        for name in ("resume", "use_gpu"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.run_dir, str) or not self.run_dir.strip():
            raise ConfigError(f"run_dir must be a directory path, got {self.run_dir!r}")
        self._merge_checkpoint_keys()
        self._resolve_tokenizer()
        self._check_pipeline()
        self._check_sharding()
        self._check_hf_model()
        self._check_tasks()
        need = self.data.max_context
        have = self.workers * self.tokens_per_worker
        if not self.pipelined and need > have:
            raise ConfigError(
                f"data.max_context={need} tokens cannot fit: {self.workers} workers x plan.tokens_per_worker="
                f"{self.tokens_per_worker} hold {have}; lower max_context, or raise workers or tokens_per_worker"
            )
        static = self.plan.static
        if static is not None:
            kind, d = static
            if d > self.workers:
                raise ConfigError(f"plan.mode={self.plan.mode!r} needs {d} workers, the run has {self.workers}")
            if kind == "ulysses" and self.model.num_heads % d:
                raise ConfigError(
                    f"plan.mode={self.plan.mode!r}: Ulysses degree {d} must divide model.num_heads="
                    f"{self.model.num_heads}; use static-ring-{d}"
                )
        self._resolve_elastic_bounds()

    def _check_pipeline(self) -> None:
        p = self.pipeline.stages
        if p == 1:  # not a pipeline: SP groups, no stage rule
            return
        if self.recompute == "selective":
            raise ConfigError(
                "sharding.activation_checkpointing = 'selective' recomputes MLPs in SP steps; pipeline stages "
                "recompute whole layers: with [pipeline] stages use 'auto' (the layers memory needs, chosen per stage "
                "and unit), 'none' or 'full'"
            )
        try:
            check_stage_count(
                p, self.workers, self.model.num_layers, self.model.num_heads, key="pipeline.stages",
                have=f"the run has {self.workers}",
            )  # fmt: skip
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.plan.static is not None:
            raise ConfigError(
                f"plan.mode={self.plan.mode!r} forces an SP layout; it cannot be combined with pipeline.stages = "
                f"{p!r} (set plan.mode = 'adaptive')"
            )

    def _check_tasks(self) -> None:
        """``[[tasks]]``: names unique, shares that make whole batches, adapters on modules the model has, something
        to train in every task; the model gets the adapters (``ModelConfig.adapters``)."""
        tasks = self.tasks
        if not isinstance(tasks, tuple) or not all(isinstance(t, TaskSettings) for t in tasks):
            raise ConfigError(f"tasks must be a tuple of TaskSettings (the [[tasks]] tables), got {tasks!r}")
        base = getattr(self.model, "base_trainable", True)
        if not tasks:
            if not base:
                raise ConfigError(
                    "[model] base_trainable = false leaves nothing to train without [[tasks]] that have adapters; "
                    "add [[tasks]] with lora_rank > 0, or remove base_trainable"
                )
            return
        names = [t.name for t in tasks]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"[[tasks]] names must be distinct; {twice} appear more than once")
        batch_counts(tasks, self.batch_size)  # raises on shares that do not sum to 1 or leave a task no document
        idle = [t.name for t in tasks if t.lora_rank == 0 and not base]
        if idle:
            raise ConfigError(
                f"[[tasks]] {idle[0]!r} has no adapter (lora_rank = 0) and [model] base_trainable = false: it would "
                "train nothing; give it a lora_rank, or set base_trainable = true"
            )
        if self.plan.static is not None:
            raise ConfigError(
                f"plan.mode={self.plan.mode!r} forces one SP layout for every document; [[tasks]] are planned per "
                "task (plan.tasks = 'spindle' or 'in_turn'): set plan.mode = 'adaptive'"
            )
        if self.pipelined:
            raise ConfigError(
                "[[tasks]] run on SP groups; pipeline stages with several tasks are not supported yet: set "
                "[pipeline] stages = 1"
            )
        shared = {k: getattr(self.data, k) for k in ("tokenizer", "max_context", "block_tokens")}
        tasks = tuple(dataclasses.replace(t, data=dataclasses.replace(t.data, **shared)) for t in tasks)
        object.__setattr__(self, "tasks", tasks)  # every task reads with the run's (resolved) tokenizer
        specs = lora_specs(tasks, self.model)
        if specs != getattr(self.model, "adapters", ()):
            object.__setattr__(self, "model", dataclasses.replace(self.model, adapters=specs))

    @property
    def task_counts(self) -> tuple[int, ...]:
        """Documents of each task in a full global batch (``flexorch.config.tasks.batch_counts``); () without
        ``[[tasks]]``."""
        return batch_counts(self.tasks, self.batch_size)

    def _merge_checkpoint_keys(self) -> None:
        """``[checkpoint] every`` / ``keep`` and the top-level ``checkpoint_every`` / ``keep_checkpoints`` are one
        setting each: the table's value is the run's; both set to different values is an error."""
        for table_key, run_key in CHECKPOINT_ALIASES.items():
            v, top = getattr(self.checkpoint, table_key), getattr(self, run_key)
            if v is None:
                continue
            default = next(f.default for f in dataclasses.fields(self) if f.name == run_key)
            if top not in (default, v):
                raise ConfigError(
                    f"checkpoint.{table_key} = {v} and the top-level {run_key} = {top} disagree; set only one of "
                    f"them ([checkpoint] {table_key} is the newer spelling)"
                )
            object.__setattr__(self, run_key, v)

    def _resolve_tokenizer(self) -> None:
        """``[data] tokenizer = 'auto'``: 'byte' for flexorch's decoder, the model directory's own tokenizer
        ('hf:DIR') for a Hugging Face model; a model directory without tokenizer files is an error. 'hf:DIR' is
        made absolute (Ray tasks tokenize elsewhere); a 'bpe:N' larger than the model's vocabulary is an error."""
        spec = self.data.tokenizer
        n = bpe_vocab(spec)
        if n is not None and n > self.model.vocab_size:
            raise ConfigError(
                f"[data] tokenizer = {spec!r} trains {n} ids but the model's embedding has vocab_size = "
                f"{self.model.vocab_size}; use 'bpe:N' with N <= {self.model.vocab_size}"
            )
        if spec.startswith("hf:") and Path(spec[3:]).expanduser().is_dir():
            spec = f"hf:{Path(spec[3:]).expanduser().resolve()}"
            object.__setattr__(self, "data", dataclasses.replace(self.data, tokenizer=spec))
        if spec != "auto":
            return
        d = self.model.hf
        if d is None:
            spec = "byte"
        elif any((Path(d) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            spec = f"hf:{d}"
        else:
            raise ConfigError(
                f"[data] tokenizer = 'auto' uses the model's own tokenizer, but the model directory {d} has none "
                "(no tokenizer.json or tokenizer_config.json); set [data] tokenizer = 'bpe:N' (a byte-level BPE "
                f"of N ids trained on the corpus at the start of the run, N <= model.vocab_size = "
                f"{self.model.vocab_size}) or 'byte' (257 ids), or put the model's tokenizer files in {d}"
            )
        object.__setattr__(self, "data", dataclasses.replace(self.data, tokenizer=spec))

    def _check_hf_model(self) -> None:
        """What a Hugging Face model ([model] hf) does not run with, said before any worker starts."""
        if self.model.hf is None:
            return
        if self.pipelined:
            raise ConfigError(
                f"pipeline.stages = {self.pipeline.stages!r} with a Hugging Face model ([model] hf): flexorch's "
                "pipeline stages cut its own decoder into layer ranges with a K/V prefix cache inside attention, "
                "which a Transformers model does not expose without forking its code; use SP steps (remove "
                "pipeline.stages), with sharding.mode = 'fsdp' for the model state"
            )

    def _check_sharding(self) -> None:
        mode, precision = self.sharding.resolved(self.use_gpu)
        s = self.sharding.shard_size
        if mode == "hsdp" and self.workers % s:
            raise ConfigError(
                f"sharding.shard_size={s} does not divide workers={self.workers}: hsdp needs whole shard groups; "
                f"use a shard_size among {[d for d in range(1, self.workers + 1) if self.workers % d == 0]}"
            )
        if self.use_gpu and precision != "bf16":
            # flexorch.workers.attention.kernels.DTYPES: on CUDA attention is fused only in fp16/bf16; the fp32
            # path there is the per-document reference loop, never a training path.
            raise ConfigError(
                f"use_gpu trains in bf16, got sharding.precision = {precision!r}: attention on CUDA runs fused "
                "only in fp16/bf16 (flash-attn or torch's own flash kernels). Set sharding.precision = 'bf16' "
                "with sharding.mode 'fsdp' or 'hsdp' (shard_size = 1 keeps whole replicas; FSDP2 keeps fp32 "
                "master weights), or leave both at 'auto'"
            )
        if precision == "bf16" and mode == "replicate":
            raise ConfigError(
                "sharding.precision = 'bf16' needs sharding.mode 'fsdp' or 'hsdp' (FSDP2 keeps the fp32 master "
                "weights and casts for compute); set mode = 'fsdp', or 'hsdp' with shard_size = 1 to keep whole "
                "replicas"
            )
        if self.sharding.gather != "layer" and (mode == "replicate" or self.pipelined):
            raise ConfigError(
                f"sharding.gather = {self.sharding.gather!r} is for SP steps with sharding.mode 'fsdp' or 'hsdp' "
                f"(this run: mode {mode!r}, pipeline.stages = {self.pipeline.stages!r}); remove it"
            )
        if mode != "replicate" and self.pipelined:
            why = None
            if self.pipeline.stages == "auto":
                why = "pipeline.stages = 'auto' can change the stage map every step; give a fixed stage count"
            elif mode == "hsdp":
                why = "a stage's parameters are sharded over the stage's workers (fsdp inside each stage)"
            elif self.model.tie_embeddings:
                why = "the first and last stage would share the tied embedding; set model.tie_embeddings = false"
            if why:
                raise ConfigError(
                    f"sharding.mode = {mode!r} with pipeline.stages = {self.pipeline.stages!r}: {why} (or use "
                    "sharding.mode = 'fsdp' with a fixed stage count, or 'replicate')"
                )

    @property
    def sharding_mode(self) -> str:
        """'replicate', 'fsdp' or 'hsdp': ``sharding.mode`` with 'auto' resolved for the device kind."""
        return self.sharding.resolved(self.use_gpu)[0]

    @property
    def precision(self) -> str:
        """'fp32' or 'bf16': ``sharding.precision`` with 'auto' resolved."""
        return self.sharding.resolved(self.use_gpu)[1]

    @property
    def recompute(self) -> str:
        """'none', 'full', 'selective' or 'auto': ``sharding.activation_checkpointing`` with its default resolved
        for the device kind and step kind."""
        return self.sharding.recompute(self.use_gpu, self.pipelined)

    @property
    def pipelined(self) -> bool:
        """Steps run as pipelines (``pipeline.stages`` is not 1)."""
        return self.pipeline.pipelined

    @property
    def min_workers(self) -> int:
        """The elastic floor in force: ``elastic.min_workers``, or the fewest workers the run can step on."""
        return self._bounds[0]

    @property
    def max_workers(self) -> int:
        """The elastic ceiling in force: ``elastic.max_workers``, or ``workers``."""
        return self._bounds[1]

    def _resolve_elastic_bounds(self) -> None:
        tpw = self.tokens_per_worker
        floor = 1  # the smallest power-of-two group that holds max_context
        while floor * tpw < self.data.max_context:
            floor *= 2
        doc_floor = floor
        if self.pipelined:  # long documents become segments: the stages, not one SP group, set the floor
            floor = 2 if self.pipeline.stages == "auto" else self.pipeline.stages
        if self.plan.static is not None:
            floor = max(floor, self.plan.static[1])
        lo = floor if self.elastic.min_workers is None else self.elastic.min_workers
        hi = self.workers if self.elastic.max_workers is None else self.elastic.max_workers
        if lo < floor:
            raise ConfigError(
                f"elastic.min_workers={lo} is too few: "
                + (
                    f"pipeline.stages = {self.pipeline.stages!r} needs {floor} workers"
                    if self.pipelined
                    else f"a document of data.max_context={self.data.max_context} tokens needs an SP group of "
                    f"{doc_floor} workers x plan.tokens_per_worker={tpw}"
                )
                + (f" (and plan.mode={self.plan.mode!r} needs {self.plan.static[1]})" if self.plan.static else "")
                + f"; set elastic.min_workers >= {floor}"
            )
        if not lo <= self.workers <= hi:
            raise ConfigError(
                f"need elastic.min_workers <= workers <= elastic.max_workers, got {lo} <= {self.workers} <= {hi}"
            )
        object.__setattr__(self, "_bounds", (lo, hi))  # derived, not a field: replace() derives them again

    @property
    def tokens_per_worker(self) -> int:
        """``plan.tokens_per_worker`` as a number: as set; 'auto' on CPU workers ``AUTO_CPU_TOKENS``; 'auto' on GPU
        workers, until the driver measured the devices (``flexorch.control.memory_budget``, which replaces it with
        the measured number), ``max_context``: no check that needs the budget refuses a run before it is known,
        and the driver checks again with the measured one."""
        t = self.plan.tokens_per_worker
        if t != "auto":
            return t
        return max(16, self.data.max_context) if self.use_gpu else AUTO_CPU_TOKENS

    @property
    def budget_from_device(self) -> bool:
        """True while ``plan.tokens_per_worker`` is 'auto' on GPU workers (the driver has yet to measure it)."""
        return self.plan.tokens_per_worker == "auto" and self.use_gpu

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)
