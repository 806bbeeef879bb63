"""Experiment trackers: the ``[tracking]`` table of a run file.

Every step record the driver writes to ``RUN_DIR/steps.jsonl`` is also sent to the trackers switched on here
(``flexorch.records.trackers``): TensorBoard event files in ``RUN_DIR/tensorboard/``, an MLflow tracking store or
server, Weights & Biases (offline into ``RUN_DIR/wandb/``, or online). None of them is needed to train: a tracker
whose package is missing is off unless the table asks for it, and one that was asked for is refused with what to
install before Ray starts (``flexorch.config.requirements``). Nothing here imports a tracker's package.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from flexorch.config.errors import ConfigError

__all__ = ["MLFLOW_DATABASES", "TRACK_INSTALL", "WANDB_MODES", "TrackingSettings"]

WANDB_MODES = ("offline", "online")
MLFLOW_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")
"""URI schemes of MLflow's database stores: they need the full ``mlflow`` package (SQLAlchemy), not mlflow-skinny."""
TRACK_INSTALL = "pip install \"flexorch[track]\" (or pip install -e '.[track]' in a checkout)"

_MLFLOW_URI_HELP = (
    "a directory ('./mlruns' or 'file:///path': a local file store), 'sqlite:///runs/mlflow.db' (or another "
    "database URI; needs the full mlflow package), 'http://host:5000' (an MLflow server) or 'databricks'"
)


def _name(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


@dataclass(frozen=True, kw_only=True)
class TrackingSettings:
    """Which experiment trackers get the run's config and every step's figures."""

    tensorboard: bool | None = None
    """TensorBoard event files in ``RUN_DIR/tensorboard/`` (``tensorboard --logdir RUN_DIR/tensorboard``). None: on
    when the ``tensorboard`` package is installed, silently off otherwise; true: required (a missing package is an
    error before the run starts); false: off."""
    mlflow: str | None = None
    """An MLflow tracking URI: a directory or ``file:`` URI (a local file store; a relative path is made absolute
    against the directory flexorch was started from), a database URI (``sqlite:///runs/mlflow.db``; needs the
    full ``mlflow`` package) or an MLflow server (``http(s)://host:port``). None: off."""
    mlflow_experiment: str = "flexorch"
    """The MLflow experiment the run is logged under (created when missing)."""
    wandb: str | None = None
    """Weights & Biases: 'offline' (no network; the run is written to ``RUN_DIR/wandb/``, ``wandb sync`` uploads
    it later) or 'online' (needs ``wandb login`` or ``WANDB_API_KEY`` where the driver runs). None: off."""
    wandb_project: str = "flexorch"
    """The W&B project of the run."""
    run_name: str | None = None
    """The run's name in every tracker. None: the run directory's name."""

    def __post_init__(self) -> None:
        if self.tensorboard is not None and not isinstance(self.tensorboard, bool):
            raise ConfigError(
                f"tracking.tensorboard must be true, false or left out (on when tensorboard is installed), "
                f"got {self.tensorboard!r}"
            )
        if self.mlflow is not None:
            object.__setattr__(self, "mlflow", _mlflow_uri(self.mlflow))
        if self.wandb is not None and self.wandb not in WANDB_MODES:
            raise ConfigError(
                f"tracking.wandb must be 'offline' (written to RUN_DIR/wandb, no network) or 'online', or left out "
                f"(off), got {self.wandb!r}"
            )
        for key in ("mlflow_experiment", "wandb_project"):
            if not _name(getattr(self, key)):
                raise ConfigError(f"tracking.{key} must be a non-empty name, got {getattr(self, key)!r}")
        if self.run_name is not None and not _name(self.run_name):
            raise ConfigError(
                f"tracking.run_name must be a non-empty name, or left out (the run directory's name), got "
                f"{self.run_name!r}"
            )

    @property
    def mlflow_database(self) -> bool:
        """``mlflow`` names a database store (the full ``mlflow`` package's SQLAlchemy stores)."""
        return self.mlflow is not None and urlparse(self.mlflow).scheme.split("+")[0] in MLFLOW_DATABASES


def _mlflow_uri(uri: object) -> str:
    """``uri`` as MLflow takes it: a directory or relative ``file:`` path becomes an absolute ``file://`` URI (the
    driver may run in another directory); a server or database URI is kept as written."""
    if not _name(uri):
        raise ConfigError(f"tracking.mlflow must be a tracking URI: {_MLFLOW_URI_HELP}; got {uri!r}")
    uri = uri.strip()
    scheme = urlparse(uri).scheme.lower()
    if uri == "databricks" or scheme in ("http", "https", "databricks") or scheme.split("+")[0] in MLFLOW_DATABASES:
        return uri
    if scheme == "file":
        path = unquote(urlparse(uri).path)
    elif scheme == "" or len(scheme) == 1:  # a path ('C:' is a drive, not a scheme)
        path = uri
    else:
        raise ConfigError(f"tracking.mlflow must be a tracking URI: {_MLFLOW_URI_HELP}; got {uri!r}")
    if not path:
        raise ConfigError(f"tracking.mlflow = {uri!r} names no directory; write e.g. 'file:///path/to/mlruns'")
    return Path(path).expanduser().resolve().as_uri()
