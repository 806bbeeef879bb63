"""One class per experiment tracker: TensorBoard, MLflow, Weights & Biases (``flexorch.records.trackers`` runs them).

Each imports its package when it opens (flexorch imports and trains without any of them) and takes a step's
figures as ``log(step, figures, wall_time)``, the step number on the x axis. On a resumed run TensorBoard goes on
in the same directory and drops the points at and after the resumed step (a ``SessionLog.START`` at that step:
TensorBoard's purge of stale events, what ``SummaryWriter(purge_step=...)`` writes), so the steps trained again
replace those the checkpoint did not keep; MLflow and W&B start a new run, tagged with the step it starts from
(``start_step``).

TensorBoard's events are written with the ``tensorboard`` package's own ``EventFileWriter`` (the writer inside
``torch.utils.tensorboard.SummaryWriter``, same files) so that ``flexorch.records`` stays free of torch.
"""

from __future__ import annotations

import json
import os
import re
import time
from abc import ABC, abstractmethod
from pathlib import Path

from flexorch.config.tracking import TrackingSettings

__all__ = ["MLflowTracker", "TensorBoardTracker", "WandbTracker", "flat_params"]


class _Tracker(ABC):
    name: str
    """The ``[tracking]`` key that switches it on."""
    where = ""
    """Where the run went, in words, for the start-up line."""

    @abstractmethod
    def log(self, step: int, figures: dict[str, float], wall_time: float) -> None:
        """One step's figures at x = ``step``."""

    def rewind(self, step: int) -> None:  # noqa: B027 - only TensorBoard can drop what it has written
        """The run went back to the checkpoint of ``step``: steps from there are trained (and logged) again."""

    @abstractmethod
    def close(self, failed: bool) -> None:
        """End the run (``failed``: the training run ended on an error)."""


class TensorBoardTracker(_Tracker):
    """Event files in ``RUN_DIR/tensorboard/``; the run config as a text summary (tag ``config``)."""

    name = "tensorboard"

    def __init__(self, settings: TrackingSettings, run_dir: Path, config: dict, run_name: str, start: int):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._Event, self._SessionLog, self._Summary, self._File = Event, SessionLog, Summary, EventFileWriter
        self.dir = run_dir / "tensorboard"
        self.where = f"events in {self.dir} (tensorboard --logdir {self.dir})"
        self._open(start)
        text = "\n".join("    " + line for line in json.dumps(config, indent=1, default=list).splitlines())
        self._writer.add_event(Event(wall_time=time.time(), step=start, summary=text_pb("config", text)))

    def _open(self, purge_step: int) -> None:
        """A new event file whose first event drops every point at ``purge_step`` or later in the directory's
        older files (a fresh run purges from 0: the directory then shows this run only)."""
        self._writer = self._File(str(self.dir), flush_secs=10)
        start = self._SessionLog(status=self._SessionLog.START)
        self._writer.add_event(self._Event(wall_time=time.time(), step=purge_step, session_log=start))

    def log(self, step: int, figures: dict[str, float], wall_time: float) -> None:
        values = [self._Summary.Value(tag=k, simple_value=v) for k, v in figures.items()]
        self._writer.add_event(self._Event(wall_time=wall_time, step=step, summary=self._Summary(value=values)))

    def rewind(self, step: int) -> None:
        self._writer.close()
        self._open(step)

    def close(self, failed: bool) -> None:
        self._writer.close()


class MLflowTracker(_Tracker):
    """A run in ``[tracking] mlflow_experiment`` at ``[tracking] mlflow``: the config as params, figures as metrics."""

    name = "mlflow"

    def __init__(self, settings: TrackingSettings, run_dir: Path, config: dict, run_name: str, start: int):
        if settings.mlflow.startswith("file:"):  # MLflow 3 refuses its file store unless told: the user named one
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils import validation

        self._Metric = Metric
        self.client = client = MlflowClient(tracking_uri=settings.mlflow)
        experiment = client.get_experiment_by_name(settings.mlflow_experiment)
        eid = experiment.experiment_id if experiment else client.create_experiment(settings.mlflow_experiment)
        tags = {"flexorch.run_dir": str(run_dir), "flexorch.start_step": str(start)}
        self.run_id = client.create_run(eid, run_name=run_name, tags=tags).info.run_id
        self.where = f"run {self.run_id} in experiment {settings.mlflow_experiment!r} at {settings.mlflow}"
        key_max = getattr(validation, "MAX_ENTITY_KEY_LENGTH", 250)  # MLflow's limits (3.x values as fallbacks)
        value_max = getattr(validation, "MAX_PARAM_VAL_LENGTH", 6000)
        params = [Param(re.sub(r"[^\w\-. /:]", "_", k)[:key_max], v) for k, v in flat_params(config, value_max).items()]
        batch = getattr(validation, "MAX_PARAMS_TAGS_PER_BATCH", 100)
        for i in range(0, len(params), batch):
            client.log_batch(self.run_id, params=params[i : i + batch])

    def log(self, step: int, figures: dict[str, float], wall_time: float) -> None:
        ms = int(wall_time * 1000)
        self.client.log_batch(self.run_id, metrics=[self._Metric(k, v, ms, step) for k, v in figures.items()])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


_WANDB_SETTINGS = {
    "silent": True,  # the driver's console line says where the run is
    "console": "off",  # no capture of the driver actor's stdout (Ray forwards it already)
    "x_disable_stats": True,  # system metrics would describe the driver's host, not the workers' devices
    "x_disable_machine_info": True,
    "save_code": False,
    "disable_git": True,
    "reinit": "create_new",  # a driver restarted in the same process starts its own run
}
"""W&B settings for a fast start inside a Ray actor; those a wandb version lacks are left out."""


class WandbTracker(_Tracker):
    """A W&B run in ``[tracking] wandb_project``, offline (``RUN_DIR/wandb/``) or online; ``step`` is the x axis of
    every figure (``define_metric``), so a run that goes back to a checkpoint logs its steps again in order."""

    name = "wandb"

    def __init__(self, settings: TrackingSettings, run_dir: Path, config: dict, run_name: str, start: int):
        import wandb

        known = getattr(wandb.Settings, "model_fields", _WANDB_SETTINGS)
        chosen = {k: v for k, v in _WANDB_SETTINGS.items() if k in known}
        self.run = wandb.init(
            project=settings.wandb_project,
            name=run_name,
            dir=str(run_dir),
            mode=settings.wandb,
            config={**config, "start_step": start},
            settings=wandb.Settings(**chosen),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.where = (
            f"offline run in {Path(self.run.dir).parent} (upload it with `wandb sync`)"
            if settings.wandb == "offline"
            else f"run {self.run.url}"
        )

    def log(self, step: int, figures: dict[str, float], wall_time: float) -> None:
        self.run.log({"step": step, **figures})

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def flat_params(config: dict, max_len: int = 6000, prefix: str = "") -> dict[str, str]:
    """The nested run config as flat ``table.key`` -> text (JSON for anything but a string), each value cut to
    ``max_len`` characters (MLflow's limit on a param's value)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, max_len, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=list)
            out[name] = text[:max_len]
    return out
