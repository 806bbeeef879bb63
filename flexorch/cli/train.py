"""`flexorch train` and `flexorch profile`: start (or join) Ray, start the TrainingDriver actor, stream progress.

The CLI process does no training work: the driver actor owns the loop, the CLI polls its events and prints one
line per step (plan shape, solve time, loss, tokens/s, predicted vs measured step time, ETA:
``flexorch.cli.train_console``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

import ray

from flexorch.cli.train_console import print_event
from flexorch.config import TrainConfig
from flexorch.control.capacity import LOCAL_RAY_ENV

__all__ = ["run_train", "run_profile", "ray_session"]


@contextmanager
def ray_session(address: str | None, workers: int):
    """Connect to ``address`` (or RAY_ADDRESS, as set by ``ray job submit``), else start a local Ray."""
    started = False
    if not ray.is_initialized():
        env = {"env_vars": {"PYTHONUNBUFFERED": "1"}}
        if address or os.environ.get("RAY_ADDRESS"):
            ray.init(address=address, runtime_env=env, log_to_driver=True)
        else:
            env["env_vars"][LOCAL_RAY_ENV] = "1"  # its own cluster: no autoscaler to ask for capacity
            # "local": a stale /tmp/ray/ray_current_cluster (left by `ray start` or a crashed run) must not make
            # a laptop run join, or fail to join, someone else's cluster
            ray.init(
                address="local",
                num_cpus=max(os.cpu_count() or 1, workers),
                include_dashboard=False,
                runtime_env=env,
                log_to_driver=True,
                # Ray starts its workers (every flexorch actor) at niceness 15: beside other busy processes they
                # would get a few per cent of a core (flexorch.control.host_load); here they get a fair share
                _system_config={"worker_niceness": 0},
            )
            started = True
    try:
        yield
    finally:
        if started:
            ray.shutdown()


class StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM (``ray job stop``, a scheduler's preemption) while a run is going: the first asks
    for a stop after the step in flight (the poll loop passes it to the driver, which checkpoints); a second one
    stops at once (KeyboardInterrupt). The handler only records the signal: Ray calls are made by the poll loop."""

    def __init__(self):
        self.received: str | None = None
        self.forwarded = False
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            raise KeyboardInterrupt(f"second {name}: stopping at once, without a checkpoint")
        self.received = name

    def wait(self, seconds: float, tick: float = 0.02) -> None:
        """Sleep up to ``seconds``, waking within ``tick`` of a signal so it is forwarded at once (the handler only
        sets a flag: no lock is taken in it)."""
        end = time.monotonic() + seconds
        while (self.received is None or self.forwarded) and (left := end - time.monotonic()) > 0:
            time.sleep(min(tick, left))

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def stop_grace_note() -> str | None:
    """Under ``ray job submit``: a warning when ``ray job stop`` would SIGKILL the job before it can checkpoint
    (Ray waits ``RAY_JOB_STOP_WAIT_TIME_S``, default 3 s, after its SIGTERM)."""
    if not os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):  # set by Ray's job supervisor for a job's entrypoint
        return None
    wait = os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", "3")
    try:
        if float(wait) >= 60:
            return None
    except ValueError:
        pass
    return (
        f"note: `ray job stop` kills this job {wait} s after its SIGTERM (RAY_JOB_STOP_WAIT_TIME_S), which may be too "
        "short to finish the step in flight and write a checkpoint; submit with --runtime-env-json "
        '\'{"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "300"}}\' (examples/submit_cluster.sh does)'
    )


def run_train(
    cfg: TrainConfig,
    address: str | None = None,
    out=sys.stdout,
    poll_s: float = 0.2,
    resume_command: str | None = None,
) -> dict:
    """Run a training job to the end, or until SIGINT/SIGTERM (then the step in flight finishes, a checkpoint is
    written and the summary has ``stopped``); returns the driver's summary (raises on failure).
    ``resume_command``: what to print to continue after a stop.

    A lost driver (its process or node died) is replaced up to ``[elastic] driver_restarts`` times by a new one
    that resumes from the run's newest checkpoint at the exact next batch (``flexorch.cli.driver_handle``)."""
    from flexorch.cli.driver_handle import DriverLost, start_driver

    again = resume_command or f"flexorch train --config {cfg.run_dir}/config.json --resume"
    with ray_session(address, cfg.workers), StopSignals() as stops:
        note = stop_grace_note()
        if note:
            print(note, file=out, flush=True)
        driver, where = start_driver(cfg.to_dict())
        print(f"flexorch train: {where}", file=out, flush=True)
        view = _RunView()
        restarts = 0
        try:
            while True:
                try:
                    return _follow(driver, cfg, view, stops, out, poll_s, again)
                except DriverLost as lost:
                    restarts += 1
                    driver = _restart_driver(driver, cfg, view, lost, stops, restarts, again, out)
                    view = _RunView(earlier=view)
        finally:
            try:
                ray.get(driver.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - the driver may already be gone; kill it
                pass
            ray.kill(driver)


def _restart_driver(driver, cfg: TrainConfig, view: _RunView, lost, stops: StopSignals, restarts, again, out):
    """Kill the lost ``driver`` and start restart number ``restarts``, which resumes from the run's newest
    checkpoint; raises `DriverLostError` when a stop was received or ``[elastic] driver_restarts`` are used up."""
    from flexorch.cli.driver_handle import start_driver

    ray.kill(driver, no_restart=True)  # its workers and planner are its own actors: they go too
    done = f"after step {view.completed}" if view.completed else "before its first step"
    head = f"flexorch train: the driver was lost {done}: {lost.reason}"
    allowed = cfg.elastic.driver_restarts
    if stops.received or restarts > allowed:
        why = f"{stops.received} was received" if stops.received else f"driver_restarts = {allowed}"
        raise DriverLostError(
            f"the driver was lost {done} ({lost.reason}); not restarted ({why}). "
            f"{view.checkpoint_words()}: go on with `{again}`"
        ) from None
    print(
        f"{head}; starting a new driver from {view.checkpoint_words().lower()} (restart {restarts} of {allowed})",
        file=out,
        flush=True,
    )
    restarted = {
        "what": "driver lost",
        "driver_restart": restarts,
        "reason": lost.reason,
        "detected_by": "ray",
        "detect_ms": max(0.0, lost.seen_at - view.last_answer) * 1e3,
        "seen_at": lost.seen_at,
        "lost_step": view.completed,
    }
    again_cfg = cfg.replace(resume=cfg.resume or view.checkpoint_step is not None)
    driver, where = start_driver(again_cfg.to_dict(), restarted=restarted)
    print(f"flexorch train: {where}", file=out, flush=True)
    return driver


class DriverLostError(RuntimeError):
    """The driver was lost more often than ``[elastic] driver_restarts`` allows (or during a stop)."""


class _RunView:
    """What the CLI has seen of a run: steps completed, the newest checkpoint, when the driver last answered."""

    def __init__(self, earlier: _RunView | None = None):
        self.completed = earlier.completed if earlier else 0
        self.checkpoint_step = earlier.checkpoint_step if earlier else None
        self.checkpoint_path = earlier.checkpoint_path if earlier else None
        self.last_answer = time.time()

    def see(self, ev: dict) -> None:
        kind = ev["event"]
        if kind == "setup" and ev.get("resumed_from") is not None:
            self.completed = int(ev["resumed_from"])
            if self.checkpoint_step is None:
                self.checkpoint_step = int(ev["resumed_from"])
        elif kind == "step":
            self.completed = int(ev["step"]) + 1
        elif kind in ("checkpoint", "emergency_checkpoint"):
            self.checkpoint_step, self.checkpoint_path = int(ev["step"]), ev["path"]

    def checkpoint_words(self) -> str:
        if self.checkpoint_step is None:
            return "No checkpoint was written yet: the run starts again from step 0"
        where = f" ({self.checkpoint_path})" if self.checkpoint_path else ""
        return f"The checkpoint of step {self.checkpoint_step}{where}"


def _follow(driver, cfg: TrainConfig, view: _RunView, stops: StopSignals, out, poll_s: float, again: str) -> dict:
    """Run ``driver`` to its end, printing its events; raises ``DriverLost`` when it is lost."""
    from flexorch.cli.driver_handle import DriverLost, poll_driver

    run_ref = driver.run.remote()
    seen, done, silent_since = 0, False, [None]
    try:
        while not done:
            if stops.received and not stops.forwarded:
                stops.forwarded = True
                print(
                    f"flexorch train: {stops.received} received: finishing the step in flight, then writing a "
                    "checkpoint (send it again to stop at once, without one)",
                    file=out,
                    flush=True,
                )
                driver.request_stop.remote(stops.received)
            got = poll_driver(driver, seen, silent_since)
            if got is None:  # no answer this time (Ray calls the actor unavailable, or the poll timed out)
                stops.wait(poll_s)
                continue
            view.last_answer = time.time()
            events, done = got
            seen += len(events)
            for ev in events:
                view.see(ev)
                print_event(ev, cfg, out)
            if not done:
                stops.wait(poll_s)
        summary = ray.get(run_ref)
    except ray.exceptions.RayTaskError as e:
        raise (e.cause if isinstance(e.cause, Exception) else RuntimeError(str(e))) from None
    except ray.exceptions.RayActorError as e:  # died after its last events were read
        from flexorch.cli.driver_handle import loss_reason

        raise DriverLost(loss_reason(e), time.time()) from e
    if summary.get("stopped"):
        print(
            f"stopped by {summary['stopped']} after step {summary['steps']} of {cfg.steps} "
            f"({summary['skipped_batches']} skipped batches); checkpoint {summary['checkpoint']}; records "
            f"{summary['records']}. Continue with: {again}",
            file=out,
            flush=True,
        )
        return summary
    print(
        f"done: {summary['steps']} steps ({summary['skipped_batches']} skipped batches); records "
        f"{summary['records']}; checkpoint {summary['checkpoint']}",
        file=out,
        flush=True,
    )
    return summary


def run_profile(cfg: TrainConfig, out_path, address: str | None = None, out=sys.stdout) -> dict:
    """Calibrate the cost model on the workers and write the profile JSON to ``out_path``."""
    from flexorch.control.calibration import calibrate_on_workers

    with ray_session(address, cfg.workers):
        profile, report = calibrate_on_workers(cfg)
    from pathlib import Path

    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(profile.to_json())
    print(report["message"], file=out)
    print(f"profile written to {out_path}; use it with `flexorch train --profile {out_path}`", file=out)
    return report
