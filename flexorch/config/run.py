"""Configuration of a training run: keyword-only dataclasses, validated on construction, loaded from TOML.

A run file (see ``examples/train_laptop.toml``) has top-level run keys and four tables::

    steps = 20            # run keys: steps, workers, batch_size, seed, run_dir, checkpoint_every, ...
    [model]               # preset = "tiny" | "small" | "llama-7b", plus any ModelConfig field to override
    [optim]               # OptimConfig fields (lr, warmup_steps, grad_clip, ...)
    [data]                # CorpusConfig fields (source, format, text_field, max_context, over_long, ...)
    [plan]                # PlanSettings fields (mode, profile, tokens_per_worker, time_limit_s, ...)

Command-line flags override the common run keys.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from flexorch.data.corpus import CorpusConfig
from flexorch.data.lengths import DataError
from flexorch.workers.model import ModelConfig, model_config
from flexorch.workers.optim import OptimConfig

__all__ = ["PlanSettings", "TrainConfig", "load_train_config", "ConfigError"]


class ConfigError(DataError):
    """A run configuration that cannot work; the message says which key and what to do."""


STATIC_MODES = ("static-ulysses", "static-ring")


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """How each step is planned."""

    mode: str = "adaptive"
    """'adaptive' (the per-step MILP planner) or a forced static layout 'static-ulysses-<d>' / 'static-ring-<d>'."""
    profile: str = "auto"
    """Cost-model profile: 'auto' (calibrate on the workers at start), a built-in name, or a profile JSON file."""
    tokens_per_worker: int = 1024
    """Activation budget of one worker in tokens: a document longer than this must be sequence-parallel."""
    time_limit_s: float = 0.5
    """Planner budget per step (the solve overlaps the previous step). A pipelined step gives it to each
    checkpointing ILP it solves (one per candidate unit count and per baseline schedule, for every layout with
    'auto'), so its solve can take several times this (0.2-1.3 s at 0.2 in examples/train_pipeline.toml);
    ``timeout_s`` still bounds it."""
    kinds: tuple[str, ...] = ("ulysses", "ring")
    """Attention methods the planner may use."""
    on_infeasible: str = "error"
    """A batch no plan can run: 'error' (stop with the reason) or 'skip' (record and count it, train on)."""
    timeout_s: float = 15.0
    """A plan not back after this long (a stuck solver) is abandoned: the planner is restarted and the step runs
    the BatchAda heuristic plan, or with pipeline stages a fully checkpointed one (recorded with status
    'fallback')."""

    def __post_init__(self) -> None:
        if self.mode != "adaptive":
            kind, _, deg = self.mode.rpartition("-")
            if kind not in STATIC_MODES or not deg.isdigit() or int(deg) < 1 or int(deg) & (int(deg) - 1):
                raise ConfigError(
                    f"plan.mode must be 'adaptive' or 'static-ulysses-<d>' / 'static-ring-<d>' with d a power of "
                    f"two, got {self.mode!r}"
                )
        if not isinstance(self.tokens_per_worker, int) or self.tokens_per_worker < 16:
            raise ConfigError(f"plan.tokens_per_worker must be an integer >= 16, got {self.tokens_per_worker!r}")
        if not self.time_limit_s > 0:
            raise ConfigError(f"plan.time_limit_s must be > 0, got {self.time_limit_s!r}")
        if not self.timeout_s > self.time_limit_s:
            raise ConfigError(f"plan.timeout_s must exceed plan.time_limit_s, got {self.timeout_s!r}")
        bad = [k for k in self.kinds if k not in ("ulysses", "ring")]
        if not self.kinds or bad:
            raise ConfigError(f"plan.kinds must be a non-empty subset of ['ulysses', 'ring'], got {list(self.kinds)}")
        if self.on_infeasible not in ("error", "skip"):
            raise ConfigError(f"plan.on_infeasible must be 'error' or 'skip', got {self.on_infeasible!r}")

    @property
    def static(self) -> tuple[str, int] | None:
        """(kind, degree) of a forced static layout, None when adaptive."""
        if self.mode == "adaptive":
            return None
        kind, _, deg = self.mode.rpartition("-")
        return kind.removeprefix("static-"), int(deg)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run."""

    steps: int = 20
    """Total steps of the run (a resumed run counts the steps already done)."""
    workers: int = 4
    """Worker actors (one per GPU, or CPU slots in CPU mode)."""
    batch_size: int = 16
    """Documents per global batch."""
    seed: int = 0
    """Seeds the model init and the data order."""
    run_dir: str = "runs/train"
    """Where the step records, the profile and the checkpoints go."""
    checkpoint_every: int = 0
    """Checkpoint every this many steps (0: only at the end)."""
    resume: bool = False
    """Continue from the newest checkpoint in ``run_dir`` (at the exact next document)."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk (oldest deleted first)."""
    worker_threads: int = 1
    """torch threads per CPU worker (one per worker on a shared machine)."""
    use_gpu: bool = False
    """One GPU per worker (NCCL) instead of CPU slots (gloo)."""
    collective_timeout_s: float = 120.0
    """A collective (or a rendezvous) waiting longer than this fails instead of hanging: the bound on how long a
    silent peer can stall the survivors before it is declared lost."""
    min_workers: int | None = None
    """Elastic floor: below this many live workers the run waits ``elastic_wait_s`` for capacity, then fails.
    Default: the fewest workers whose largest power-of-two SP group holds ``data.max_context`` (and a forced static
    layout's degree)."""
    max_workers: int | None = None
    """Elastic ceiling: free slots in the cluster (a joined node) are used up to this many workers. Default:
    ``workers`` (replace lost workers when capacity comes back, never grow past the start)."""
    elastic_wait_s: float = 60.0
    """How long to wait for capacity when fewer than ``min_workers`` are alive, before failing the run."""
    max_attempts: int = 5
    """Attempts at one step (each membership failure costs one) before the run gives up."""
    pipeline_stages: int | str = 1
    """1: every step is planned as SP groups (FlexSP). P >= 2: the model's layers are split over P pipeline stages,
    each a group of ``workers // P`` workers (Ulysses SP inside a stage), and every step runs a 1F1B schedule whose
    units (Seq1F1B segments, InfiniPipe packing) and checkpointing are planned for its batch. 'auto': the fastest
    simulated stages x workers-per-stage split, chosen per step."""
    pipeline_params: str = "stage"
    """With pipeline stages, where parameters and optimizer state live. 'stage': each worker holds only its stage's
    layers (a stage's share of the model's memory); parts are copied between workers when the stage map changes,
    and a part whose every holder is lost sends the run back to its last checkpoint. 'replicated': every worker
    keeps the whole model (more memory; any single survivor can carry the run on)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: CorpusConfig = field(default_factory=CorpusConfig)
    plan: PlanSettings = field(default_factory=PlanSettings)

    def __post_init__(self) -> None:
        for name in ("steps", "workers", "batch_size", "keep_checkpoints"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every must be an integer >= 0, got {self.checkpoint_every!r}")
        if not self.collective_timeout_s > 0:
            raise ConfigError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s!r}")
        if not self.elastic_wait_s >= 0:
            raise ConfigError(f"elastic_wait_s must be >= 0, got {self.elastic_wait_s!r}")
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be a positive integer, got {self.max_attempts!r}")
        self._check_pipeline()
        need = self.data.max_context
        have = self.workers * self.plan.tokens_per_worker
        if self.pipeline_stages == 1 and need > have:
            raise ConfigError(
                f"data.max_context={need} tokens cannot fit: {self.workers} workers x plan.tokens_per_worker="
                f"{self.plan.tokens_per_worker} hold {have}; lower max_context, or raise workers or tokens_per_worker"
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
        p = self.pipeline_stages
        if p == "auto":
            if self.workers < 2:
                raise ConfigError("pipeline_stages = 'auto' needs at least 2 workers")
        elif not isinstance(p, int) or isinstance(p, bool) or p < 1:
            raise ConfigError(f"pipeline_stages must be a positive integer or 'auto', got {p!r}")
        elif p > self.model.num_layers:
            raise ConfigError(
                f"pipeline_stages = {p} but the model has {self.model.num_layers} layers: every stage needs at least "
                f"one layer; use at most {self.model.num_layers} stages"
            )
        elif p > self.workers:
            raise ConfigError(f"pipeline_stages = {p} needs at least {p} workers, the run has {self.workers}")
        elif p > 1 and self.model.num_heads % (self.workers // p):
            raise ConfigError(
                f"pipeline_stages = {p} on {self.workers} workers puts {self.workers // p} workers on a stage "
                f"(Ulysses inside the stage), which must divide model.num_heads={self.model.num_heads}"
            )
        if self.pipeline_params not in ("stage", "replicated"):
            raise ConfigError(f"pipeline_params must be 'stage' or 'replicated', got {self.pipeline_params!r}")
        if p != 1 and self.plan.static is not None:
            raise ConfigError(
                f"plan.mode={self.plan.mode!r} forces an SP layout; it cannot be combined with pipeline_stages = "
                f"{p!r} (set plan.mode = 'adaptive')"
            )

    @property
    def pipelined(self) -> bool:
        return self.pipeline_stages != 1

    def _resolve_elastic_bounds(self) -> None:
        tpw = self.plan.tokens_per_worker
        floor = 1  # the smallest power-of-two group that holds max_context
        while floor * tpw < self.data.max_context:
            floor *= 2
        doc_floor = floor
        if self.pipelined:  # long documents become segments: the stages, not one SP group, set the floor
            floor = 2 if self.pipeline_stages == "auto" else self.pipeline_stages
        if self.plan.static is not None:
            floor = max(floor, self.plan.static[1])
        lo = floor if self.min_workers is None else self.min_workers
        hi = self.workers if self.max_workers is None else self.max_workers
        for name, v in (("min_workers", lo), ("max_workers", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if lo < floor:
            raise ConfigError(
                f"min_workers={lo} is too few: "
                + (
                    f"pipeline_stages = {self.pipeline_stages!r} needs {floor} workers"
                    if self.pipelined
                    else f"a document of data.max_context={self.data.max_context} tokens needs an SP group of "
                    f"{doc_floor} workers x plan.tokens_per_worker={tpw}"
                )
                + (f" (and plan.mode={self.plan.mode!r} needs {self.plan.static[1]})" if self.plan.static else "")
                + f"; set min_workers >= {floor}"
            )
        if not lo <= self.workers <= hi:
            raise ConfigError(f"need min_workers <= workers <= max_workers, got {lo} <= {self.workers} <= {hi}")
        object.__setattr__(self, "min_workers", lo)
        object.__setattr__(self, "max_workers", hi)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)


_RUN_KEYS = {f.name for f in dataclasses.fields(TrainConfig)} - {"model", "optim", "data", "plan"}


def _build(cls, table: dict, where: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"[{where}]: unknown keys {unknown}; known: {sorted(known)}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}
    try:
        return cls(**values)
    except DataError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"[{where}]: {e}") from None


def config_from_dict(values: dict) -> TrainConfig:
    """A :class:`TrainConfig` from a nested dict (a parsed TOML file, or ``TrainConfig.to_dict()``)."""
    values = {k.replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(values) - _RUN_KEYS - {"model", "optim", "data", "plan"})
    if unknown:
        raise ConfigError(
            f"unknown keys {unknown}; run keys are {sorted(_RUN_KEYS)} plus [model] [optim] [data] [plan]"
        )
    model_table = dict(values.pop("model", {}) or {})
    preset = model_table.pop("preset", "tiny")
    try:
        base = model_config(preset).to_dict()
        base.update(model_table)
        model = ModelConfig.from_dict(base)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"[model]: {e}") from None
    optim = _build(OptimConfig, dict(values.pop("optim", {}) or {}), "optim")
    data = _build(CorpusConfig, dict(values.pop("data", {}) or {}), "data")
    plan = _build(PlanSettings, dict(values.pop("plan", {}) or {}), "plan")
    try:
        return TrainConfig(model=model, optim=optim, data=data, plan=plan, **values)
    except TypeError as e:
        raise ConfigError(str(e)) from None


def load_train_config(path: Path | str | None, overrides: dict | None = None) -> TrainConfig:
    """Read a TOML run file (or defaults when ``path`` is None) and apply flag ``overrides`` (None values skipped)."""
    values: dict = {}
    if path is not None:
        path = Path(path)
        try:
            values = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    for key, v in (overrides or {}).items():
        if v is None:
            continue
        if "." in key:
            table, sub = key.split(".", 1)
            values.setdefault(table, {})[sub] = v
        else:
            values[key] = v
    try:
        return config_from_dict(values)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path is not None else str(e)) from None
