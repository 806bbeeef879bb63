"""Every step record, also sent to the experiment trackers of the ``[tracking]`` table (TensorBoard, MLflow, W&B).

The driver opens :class:`Trackers` after its step records, hands it each record right after writing it to
``steps.jsonl`` and closes it when the run ends (done, stopped or failed). A record becomes a few numbers,
:func:`step_figures`, logged at x = the step number; the run config goes along once (TensorBoard: a text summary,
MLflow: params, W&B: the run's config). ``steps.jsonl`` stays the run's full account; the trackers are views of it.

Trackers never stop the training run: they are written from a thread of their own, so a slow server does not
delay a step, and a tracker that fails (at start or while logging) is reported once and switched off while the
others go on. A tracker the table asks for whose package is missing is a ``ConfigError`` (``flexorch train``
refuses it before Ray starts: ``flexorch.config.requirements``); TensorBoard left unset is on only when
installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import queue
import re
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from flexorch.config.errors import ConfigError
from flexorch.config.tracking import TRACK_INSTALL, TrackingSettings
from flexorch.records.tracker_backends import MLflowTracker, TensorBoardTracker, WandbTracker

__all__ = ["FIGURES", "Trackers", "step_figures"]

FIGURES = (
    "loss tokens_per_s lr grad_norm measured_ms predicted_ms compute_ms solve_s plan_wait_ms plan_budget_s gap "
    "tokens targets epoch router_aux_loss router_ms"
).split()
"""Record keys logged under their own name whenever the record has a number there (``flexorch.records.schema``
says what each means): a skipped step has no loss, an unplanned one no ``gap``."""

_BACKENDS = ((TensorBoardTracker, "tensorboard"), (MLflowTracker, "mlflow"), (WandbTracker, "wandb"))
"""Each tracker with the module it needs."""
_QUEUE = 10_000  # steps a stalled tracker may fall behind before steps are dropped (a few MB of figures)
_STOP = object()


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def step_figures(record: dict) -> dict[str, float]:
    """The numbers of one step record worth a chart: :data:`FIGURES`, ``workers`` (the world that ran it),
    ``skipped`` (1 when no plan fitted), ``recoveries`` (membership changes made for it), the plan's shape
    (``micro_batches`` and SP ``groups``, or pipeline ``stages`` and ``units``) and each task's loss as
    ``loss/<task>`` when the record carries ``task_losses``."""
    out = {k: float(record[k]) for k in FIGURES if _number(record.get(k))}
    out["workers"] = float(record["world_size"])
    out["skipped"] = float(bool(record.get("skipped")))
    out["recoveries"] = float(len(record.get("recoveries") or ()))
    if record.get("plan"):
        mbs = record["plan"]["micro_batches"]
        out["micro_batches"], out["groups"] = float(len(mbs)), float(sum(len(mb) for mb in mbs))
    if record.get("pipeline"):
        out["stages"], out["units"] = float(record["pipeline"]["stages"]), float(len(record["pipeline"]["units"]))
    for task, loss in (record.get("task_losses") or {}).items():
        if _number(loss):  # names kept to what every tracker takes in a metric's name
            out[f"loss/{re.sub(r'[^A-Za-z0-9_.-]', '_', str(task))}"] = float(loss)
    return out


class Trackers:
    """The run's open trackers, fed from one thread. :meth:`open` them; :meth:`log_step`, :meth:`rewind` and
    :meth:`close` return at once (close waits for what is queued, at most ``timeout_s``)."""

    def __init__(self, trackers: list, say: Callable[[str], None] | None = None):
        self._trackers = list(trackers)
        self._say = say
        self._queue: queue.Queue = queue.Queue(maxsize=_QUEUE)
        self._dropped = False
        self._closed = not self._trackers
        self._thread = None
        if self._trackers:
            self._thread = threading.Thread(target=self._drain, name="flexorch-trackers", daemon=True)
            self._thread.start()

    @classmethod
    def open(
        cls,
        settings: TrackingSettings,
        run_dir: Path | str,
        config: dict,
        resumed_from: int | None = None,
        say: Callable[[str], None] | None = None,
    ) -> Trackers:
        """Open the trackers ``settings`` switch on for the run in ``run_dir`` with ``config`` (``to_dict()`` of
        the run's ``TrainConfig``), continuing from step ``resumed_from`` (None: a fresh run). ``say`` gets one
        line per tracker opened or failed (None: failures become ``warnings``)."""
        run_dir = Path(run_dir).resolve()
        name = settings.run_name or run_dir.name
        start = resumed_from or 0
        wanted = {
            "tensorboard": settings.tensorboard,
            "mlflow": settings.mlflow is not None,
            "wandb": settings.wandb is not None,
        }
        opened = []
        for tracker, module in _BACKENDS:
            asked = wanted[tracker.name]
            if asked is False or (asked is None and importlib.util.find_spec(module) is None):
                continue  # off, or TensorBoard left unset and not installed
            try:
                opened.append(tracker(settings, run_dir, config, name, start))
            except ImportError as e:
                if asked:
                    for t in opened:
                        with contextlib.suppress(Exception):
                            t.close(True)
                    raise ConfigError(
                        f"[tracking] {tracker.name} is on but {module} cannot be imported where the driver runs "
                        f"({e}): {TRACK_INSTALL}"
                    ) from None
                _tell(say, f"tracking: {tracker.name} is installed but does not import ({e}); it is off")
            except Exception as e:  # noqa: BLE001 - a tracker that cannot start must not stop the run
                _tell(say, f"tracking: {tracker.name} could not start ({type(e).__name__}: {e}); it is off")
        for t in opened:
            _tell(say, f"tracking: {t.name} {t.where}", warn=False)
        return cls(opened, say)

    @property
    def names(self) -> list[str]:
        """The trackers still on."""
        return [t.name for t in self._trackers]

    def log_step(self, record: dict) -> None:
        """Queue one step record (as ``StepRecords.append`` returned it) for every tracker."""
        self._put(("log", record["step"], step_figures(record), record.get("time", time.time())))

    def rewind(self, step: int) -> None:
        """The run went back to its checkpoint at ``step`` (a roll-back): TensorBoard drops its points from there."""
        self._put(("rewind", step))

    def close(self, failed: bool = False, timeout_s: float = 60.0) -> None:
        """End every tracker's run (``failed``: the training run ended on an error), after what is queued."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put((_STOP, failed), timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            _tell(self._say, f"tracking: {', '.join(self.names)} still busy after {timeout_s:.0f} s; left behind")

    def _put(self, item: tuple) -> None:
        if self._closed:
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            if not self._dropped:
                self._dropped = True
                _tell(self._say, f"tracking: trackers are {_QUEUE} steps behind; dropping steps until they catch up")

    def _drain(self) -> None:
        while True:
            op, *args = self._queue.get()
            for t in list(self._trackers):
                try:
                    if op is _STOP:
                        t.close(*args)
                    else:
                        getattr(t, op)(*args)
                except Exception as e:  # noqa: BLE001 - a tracker's failure is never the run's
                    self._drop(t, e)
            if op is _STOP:
                return

    def _drop(self, tracker, err: Exception) -> None:
        """Switch ``tracker`` off after ``err``, saying so once."""
        self._trackers.remove(tracker)
        _tell(
            self._say,
            f"tracking: {tracker.name} failed ({type(err).__name__}: {err}); it is off for the rest of the run "
            "(steps.jsonl has every step)",
        )
        with contextlib.suppress(Exception):
            tracker.close(True)


def _tell(say: Callable[[str], None] | None, message: str, warn: bool = True) -> None:
    """``message`` to ``say``; without one, a warning (``warn``) or nothing (a note)."""
    if say is not None:
        say(message)
    elif warn:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
