"""Reading a run file: TOML (or a nested dict) to a :class:`~flexorch.config.run.TrainConfig`, flags applied.

Every key must be known: an unknown key is an error listing the known ones, and a key that moved into a table
(``min_workers`` is now ``[elastic] min_workers``) is an error naming its new place, never silently ignored.
Reading a file imports neither Ray nor torch.
"""

from __future__ import annotations

import dataclasses
import keyword
import tomllib
from pathlib import Path

from flexorch.config.errors import ConfigError
from flexorch.config.hf import hf_model_config
from flexorch.config.model import RUN_KEYS, ModelConfig, model_config
from flexorch.config.run import CHECKPOINT_ALIASES, TrainConfig
from flexorch.config.run import TABLES as RUN_TABLES
from flexorch.config.tasks import task_from_dict

__all__ = ["MOVED_KEYS", "config_from_dict", "load_train_config"]

TABLES = {name: cls for name, cls in RUN_TABLES.items() if name != "model"}
"""The tables built field by field (``[model]`` also takes ``preset``)."""

MOVED_KEYS = {
    "min_workers": ("elastic", "min_workers"),
    "max_workers": ("elastic", "max_workers"),
    "elastic_wait_s": ("elastic", "wait_s"),
    "max_attempts": ("elastic", "max_attempts"),
    "collective_timeout_s": ("elastic", "collective_timeout_s"),
    "pipeline_stages": ("pipeline", "stages"),
    "pipeline_params": ("pipeline", "params"),
}
"""Top-level keys of earlier versions and the (table, key) they moved to."""

_RUN_KEYS = {f.name for f in dataclasses.fields(TrainConfig)} - {"model", "tasks", *TABLES}

MODEL_TRAINING_KEYS = frozenset({"base_trainable", "adapters"})
"""``[model]`` keys about what trains, allowed beside ``hf = DIR`` (``adapters`` is written back by a saved config;
a run file sets adapters in ``[[tasks]]``)."""


def _table(values: dict, name: str) -> dict:
    table = values.pop(name, None) or {}
    if not isinstance(table, dict):
        raise ConfigError(f"[{name}] must be a table of keys, got {name} = {table!r}")
    return {_field_name(k.replace("-", "_")): v for k, v in table.items()}


def _field_name(key: str) -> str:
    """A table key as its dataclass field: a Python keyword gets a trailing underscore (``async`` -> ``async_``)."""
    return f"{key}_" if keyword.iskeyword(key) else key


def _build(cls, table: dict, where: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        shown = sorted(k[:-1] if keyword.iskeyword(k[:-1]) else k for k in known)  # async_ is written async
        raise ConfigError(f"[{where}]: unknown keys {unknown}; known: {shown}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}
    try:
        return cls(**values)
    except ConfigError:  # its message names the table's key already ("plan.mode must be ...")
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"[{where}]: {e}") from None


def config_from_dict(values: dict) -> TrainConfig:
    """A :class:`TrainConfig` from a nested dict (a parsed TOML file, or ``TrainConfig.to_dict()``)."""
    values = {k.replace("-", "_"): v for k, v in values.items()}
    moved = sorted(k for k in values if k in MOVED_KEYS)
    if moved:
        where = "; ".join(f"{k} is now [{MOVED_KEYS[k][0]}] {MOVED_KEYS[k][1]}" for k in moved)
        raise ConfigError(f"keys moved into tables: {where} (write them under that table)")
    unknown = sorted(set(values) - _RUN_KEYS - {"model", "tasks", *TABLES})
    if unknown:
        tables = " ".join(f"[{t}]" for t in ("model", *TABLES)) + " [[tasks]]"
        raise ConfigError(f"unknown keys {unknown}; run keys are {sorted(_RUN_KEYS)} plus {tables}")
    model_table = _table(values, "model")
    try:
        model = _model(model_table)
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"[model]: {e}") from None
    tables = {name: _build(cls, _table(values, name), name) for name, cls in TABLES.items()}
    tasks = values.pop("tasks", None) or []
    if not isinstance(tasks, list | tuple):
        raise ConfigError(f"tasks must be [[tasks]] tables (an array of tables), got tasks = {tasks!r}")
    tasks = tuple(task_from_dict(t, tables["data"], i) for i, t in enumerate(tasks))
    try:
        return TrainConfig(model=model, **tables, **values, tasks=tasks)
    except TypeError as e:
        raise ConfigError(str(e)) from None


def _model(table: dict) -> ModelConfig:
    """``[model]``: a preset with overrides, or ``hf = "DIR"`` alone (a Hugging Face model directory; a table
    that also has ``family`` is a saved config read back, whose fields are already the directory's)."""
    if table.get("hf") is not None and "family" not in table:
        others = sorted(set(table) - {"hf"} - RUN_KEYS - MODEL_TRAINING_KEYS)
        if others:
            raise ConfigError(
                f"[model]: with hf = {table['hf']!r} the model's shape comes from its config.json; remove {others}"
            )
        kept = {k: table[k] for k in (RUN_KEYS | MODEL_TRAINING_KEYS) & set(table)}
        return ModelConfig.from_dict({**hf_model_config(table["hf"]), **kept})
    preset = table.pop("preset", "tiny")
    return ModelConfig.from_dict({**model_config(preset).to_dict(), **table})


def load_train_config(path: Path | str | None, overrides: dict | None = None) -> TrainConfig:
    """Read a TOML run file (or defaults when ``path`` is None) and apply flag ``overrides`` (None values skipped;
    ``"table.key"`` names a key of a table, e.g. ``"elastic.min_workers"``)."""
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
            if not isinstance(values.setdefault(table, {}), dict):
                raise ConfigError(f"{path}: [{table}] must be a table of keys, got {table} = {values[table]!r}")
            values[table][sub] = v
        else:
            values[key] = v
        if key in CHECKPOINT_ALIASES.values():  # a flag wins over the [checkpoint] spelling of the file as well
            table = values.get("checkpoint")
            alias = next(k for k, run_key in CHECKPOINT_ALIASES.items() if run_key == key)
            if isinstance(table, dict) and alias in table:
                table[alias] = v
    try:
        return config_from_dict(values)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path is not None else str(e)) from None
