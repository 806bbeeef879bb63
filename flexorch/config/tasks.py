"""``[[tasks]]``: several fine-tuning tasks over one base model in one run (Spindle, arXiv 2409.03365).

Each task has its own data (any source and record kind the corpus reader takes; the run's ``[data]`` table gives
the defaults, and the tokenizer and ``max_context`` are the run's), its weight in the loss, its share of every
global batch and what it trains: a LoRA adapter of its own (``lora_rank`` > 0; Hu et al., arXiv 2106.09685) on the
shared decoder layers, and the shared base when ``[model] base_trainable`` (the default) says so::

    [model]
    base_trainable = false          # only the adapters train

    [[tasks]]
    name = "chat"
    source = "data/chat.jsonl"      # any [data] key but tokenizer / max_context / block_tokens
    share = 0.5                     # of each global batch (all tasks give one, summing to 1, or none: equal)
    weight = 1.0                    # in the loss: sum_t weight_t * loss_t / sum_t weight_t
    lora_rank = 8
    lora_alpha = 16                 # scale alpha / rank (default: alpha = rank)
    lora_targets = ["wq", "wv"]     # leaf names of the decoder layers' linear maps (default: q and v)

A run without ``[[tasks]]`` is one task on ``[data]``. Pure data (no torch): everything here is checked when the run
file is read, before Ray starts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from flexorch.config.data import CorpusConfig
from flexorch.config.errors import ConfigError

__all__ = [
    "SHARED_DATA_KEYS",
    "TASK_KEYS",
    "TaskSettings",
    "batch_counts",
    "default_targets",
    "lora_specs",
    "task_from_dict",
]

TASK_KEYS = frozenset({"name", "weight", "share", "lora_rank", "lora_alpha", "lora_targets"})
"""A task's own keys; every other key of a ``[[tasks]]`` table is a ``[data]`` key for its data."""

SHARED_DATA_KEYS = frozenset({"tokenizer", "max_context", "block_tokens"})
"""``[data]`` keys every task shares with the run (one vocabulary, one context length, one block size)."""


@dataclass(frozen=True, kw_only=True)
class TaskSettings:
    """One ``[[tasks]]`` table, checked on construction."""

    name: str
    """Shown in records, step lines and trackers (``loss/<name>``); a Python identifier."""
    data: CorpusConfig
    """The task's documents: the run's ``[data]`` with the task's own keys over it."""
    weight: float = 1.0
    """Weight of the task's mean loss per target token in the step's loss."""
    share: float | None = None
    """Fraction of every global batch (documents) drawn from this task; None: an equal split."""
    lora_rank: int = 0
    """Rank of the task's LoRA adapter; 0: none (the task trains the shared base only)."""
    lora_alpha: float | None = None
    """LoRA scale numerator (scale = alpha / rank, PEFT's convention); None: the rank (scale 1)."""
    lora_targets: tuple[str, ...] | None = None
    """Leaf names of the decoder layers' linear maps the adapter is on; None: the query and value projections."""

    def __post_init__(self) -> None:
        where = f"[[tasks]] {self.name!r}"
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ConfigError(
                f"[[tasks]] name must be a name like 'chat' or 'code_review' (letters, digits, _), got {self.name!r}"
            )
        if not isinstance(self.data, CorpusConfig):
            raise ConfigError(f"{where}: data must be a CorpusConfig, got {type(self.data).__name__}")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, int | float) or not 0 < w < math.inf:
            raise ConfigError(f"{where}: weight must be a number > 0, got {w!r}")
        s = self.share
        if s is not None and (isinstance(s, bool) or not isinstance(s, int | float) or not 0 < s <= 1):
            raise ConfigError(f"{where}: share must be a fraction in (0, 1] of each global batch, got {s!r}")
        r = self.lora_rank
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ConfigError(f"{where}: lora_rank must be an integer >= 0 (0: no adapter), got {r!r}")
        a = self.lora_alpha
        if a is not None and (isinstance(a, bool) or not isinstance(a, int | float) or not 0 < a < math.inf):
            raise ConfigError(f"{where}: lora_alpha must be a number > 0, got {a!r}")
        t = self.lora_targets
        if t is not None:
            if isinstance(t, str) or not isinstance(t, tuple | list) or not t or not all(isinstance(x, str) for x in t):
                raise ConfigError(f"{where}: lora_targets must be a non-empty list of module names, got {t!r}")
            object.__setattr__(self, "lora_targets", tuple(t))
        if r == 0 and (a is not None or t is not None):
            raise ConfigError(f"{where}: lora_alpha / lora_targets need an adapter: set lora_rank > 0, or remove them")

    @property
    def alpha(self) -> float:
        return float(self.lora_rank if self.lora_alpha is None else self.lora_alpha)


def task_from_dict(values: dict, run_data: CorpusConfig, index: int) -> TaskSettings:
    """A task from a ``[[tasks]]`` table (flat: task keys + ``[data]`` keys) or from ``TaskSettings`` as
    ``dataclasses.asdict`` wrote it (a ``data`` table: a saved config read back)."""
    if not isinstance(values, dict):
        raise ConfigError(f"[[tasks]] entry {index + 1} must be a table of keys, got {values!r}")
    values = {k.replace("-", "_"): v for k, v in values.items()}
    name = values.get("name")
    where = f"[[tasks]] {name!r}" if name is not None else f"[[tasks]] entry {index + 1}"
    if name is None:
        raise ConfigError(f'{where} needs a name (e.g. name = "chat")')
    own = {k: v for k, v in values.items() if k in TASK_KEYS}
    if isinstance(values.get("data"), dict):  # a saved config: the task's whole data table
        rest = sorted(set(values) - TASK_KEYS - {"data"})
        if rest:
            raise ConfigError(f"{where}: unknown keys {rest}")
        data_keys = dict(values["data"])
    else:
        data_keys = {k: v for k, v in values.items() if k not in TASK_KEYS}
        shared = sorted(set(data_keys) & SHARED_DATA_KEYS)
        if shared:
            raise ConfigError(
                f"{where}: {shared} are the run's, shared by every task (one vocabulary, one context length); "
                "set them in [data]"
            )
        known = {f.name for f in dataclasses.fields(CorpusConfig)}
        unknown = sorted(set(data_keys) - known)
        if unknown:
            raise ConfigError(
                f"{where}: unknown keys {unknown}; a task takes {sorted(TASK_KEYS)} and the [data] keys "
                f"{sorted(known - SHARED_DATA_KEYS)}"
            )
        data_keys = {**dataclasses.asdict(run_data), **data_keys}
    data_keys = {k: tuple(v) if isinstance(v, list) else v for k, v in data_keys.items()}
    try:
        data = CorpusConfig(**data_keys)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
    if isinstance(own.get("lora_targets"), list):
        own["lora_targets"] = tuple(own["lora_targets"])
    try:
        return TaskSettings(data=data, **own)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def batch_counts(tasks, batch_size: int) -> tuple[int, ...]:
    """Documents of each task in a full global batch of ``batch_size``: share x batch_size, rounded by largest
    remainder so they sum to ``batch_size``; every task gets at least one (else a ConfigError saying what to
    change). Shares must all be given (summing to 1) or none (an equal split)."""
    if not tasks:
        return ()
    given = [t.share is not None for t in tasks]
    if any(given) and not all(given):
        missing = [t.name for t in tasks if t.share is None]
        raise ConfigError(f"[[tasks]]: give every task a share or none (an equal split); {missing} have none")
    shares = [t.share for t in tasks] if all(given) else [1.0 / len(tasks)] * len(tasks)
    total = sum(shares)
    if not math.isclose(total, 1.0, rel_tol=0, abs_tol=1e-6):
        terms = " + ".join(f"{s:g} ({t.name})" for s, t in zip(shares, tasks, strict=True))
        raise ConfigError(f"[[tasks]] shares must sum to 1: {terms} = {total:g}; scale them or leave them all out")
    raw = [s * batch_size for s in shares]
    counts = [math.floor(x) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: (counts[i] - raw[i], i))[: batch_size - sum(counts)]:
        counts[i] += 1
    few = [(t.name, s, c) for t, s, c in zip(tasks, shares, counts, strict=True) if c < 1]
    if few:
        name, s, _ = few[0]
        raise ConfigError(
            f"[[tasks]] {name!r}: share {s:g} of batch_size {batch_size} is {s * batch_size:.2f} documents, less than "
            f"one per step; raise its share or batch_size (at least {math.ceil(1 / s)})"
        )
    return tuple(counts)


def default_targets(model_cfg) -> tuple[str, ...]:
    """The query and value projections (LoRA's own choice, arXiv 2106.09685 §7.1; PEFT's default for Llama)."""
    from flexorch.config.adapters import target_modules

    have = target_modules(model_cfg)
    for pair in (("wq", "wv"), ("q_proj", "v_proj")):
        if set(pair) <= set(have):
            return pair
    return have[:1]


def lora_specs(tasks, model_cfg) -> tuple:
    """``flexorch.config.adapters.LoraSpec`` of every task with an adapter, checked against this model
    (``check_adapters``: an unknown target is a ConfigError listing the model's)."""
    from flexorch.config.adapters import LoraSpec, check_adapters

    specs = []
    for t in tasks:
        if t.lora_rank == 0:
            continue
        targets = tuple(t.lora_targets or default_targets(model_cfg))
        try:
            specs.append(LoraSpec(task=t.name, rank=t.lora_rank, alpha=t.alpha, targets=targets))
        except ValueError as e:
            raise ConfigError(f"[[tasks]] {t.name!r}: {e}") from None
    try:
        check_adapters(model_cfg, specs)
    except ValueError as e:
        raise ConfigError(f"[[tasks]]: {e}") from None
    return tuple(specs)
