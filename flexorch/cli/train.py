"""`flexorch train` and `flexorch profile`: start (or join) Ray, start the TrainingDriver actor, stream progress.

The CLI process does no training work: the driver actor owns the loop, the CLI polls its events and prints one
line per step (plan shape, solve time, loss, tokens/s, predicted vs measured step time, ETA).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

import ray

from flexorch.config import TrainConfig
from flexorch.control.capacity import LOCAL_RAY_ENV
from flexorch.solver.recompute import describe as describe_recompute

__all__ = ["run_train", "run_profile", "ray_session", "format_step", "format_membership"]


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


def _fmt_eta(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def format_step(ev: dict, total: int) -> str:
    head = f"step {ev['step'] + 1:>4}/{total}"
    if ev.get("skipped"):
        return f"{head}  SKIPPED (no plan fits: {ev['reason']})  ETA {_fmt_eta(ev['eta_s'])}"
    fb = ev.get("fallback")
    plan = f"{ev['shape']} [fallback: {fb['reason']}]" if fb else ev["shape"]
    budget = f"/{ev['plan_budget_s']:.2f}" if ev.get("plan_budget_s") else ""  # of the budget the plan had
    gap = f" gap {ev['gap'] * 100:4.1f}%" if ev.get("gap") is not None else ""
    targets = ev.get("targets")  # loss masks: the loss is over these tokens only
    of = f" on {targets:,} of {ev['tokens']:,} tokens" if targets is not None and targets != ev["tokens"] else ""
    line = (
        f"{head}  plan {plan:<18s} solve {ev['solve_s']:5.2f}{budget}s{gap}  loss {ev['loss']:7.4f}{of}  "
        f"tok/s {ev['tokens_per_s']:>8,.0f}  pred {ev['predicted_ms']:7.1f} ms  meas {ev['measured_ms']:7.1f} ms "
        f"(compute {ev['compute_ms']:7.1f} ms)  ETA {_fmt_eta(ev['eta_s'])}"
    )
    if ev.get("task_losses"):  # [[tasks]]: each task's own loss (the step's is their weighted mean)
        line += "  [" + ", ".join(f"{n} {x:.4f}" for n, x in ev["task_losses"].items()) + "]"
    if ev.get("recompute"):  # 'auto' recompute: how many groups ran without, and the packing the planner chose
        packing = (ev.get("recompute_packing") or {}).get("packing")
        packed = {"none": " (packed for no recompute)", "selective": " (packed for selective recompute)"}
        packed = packed.get(packing, "")
        line += f"  [{describe_recompute(ev['recompute'])}{packed}]"
    pipe = ev.get("pipeline")
    if pipe and any(map(any, pipe["checkpointed"])):  # stages: the layer runs their checkpointing recomputes
        runs = sum(n * len(row) for n, row in zip(pipe["layers"], pipe["checkpointed"], strict=True))
        line += f"  [recompute: {sum(map(sum, pipe['checkpointed']))} of {runs} layer runs]"
    compiled = max((r.get("compile_s") or 0.0 for r in ev.get("ranks") or () if r), default=0.0)
    if compiled >= 0.05:  # the first steps of a compiled model (and a recompile): torch.compile's own time
        line += f"  [compiling the layers: {compiled:.1f} s of it]"
    for rec in ev.get("recoveries") or ():
        if rec.get("driver_restart"):  # the driver was lost and a new one took over from the last checkpoint
            corpus = f" (corpus {rec['corpus_ms'] / 1e3:.1f} s)" if "corpus_ms" in rec else ""  # the new driver's
            line += (
                f"  [driver restarted, recovered in {rec['total_ms'] / 1e3:.1f} s: detect {rec['detect_ms'] / 1e3:.1f}"
                f" s, new driver {rec['recovery_ms'] / 1e3:.1f} s{corpus}, re-run {rec['rerun_ms'] / 1e3:.1f} s "
                f"({rec['redone_steps']} step{'' if rec['redone_steps'] == 1 else 's'} trained again)]"
            )
        elif "total_ms" in rec:  # a failure during this step: the time it cost, as lived
            line += (
                f"  [recovered in {rec['total_ms'] / 1e3:.1f} s: detect {rec.get('detect_ms', 0.0) / 1e3:.1f} s, "
                f"re-form {rec['recovery_ms'] / 1e3:.1f} s, re-run {rec['rerun_ms'] / 1e3:.1f} s]"
            )
    return line


def format_membership(ev: dict) -> str:
    """One line per membership change: workers lost (and what was done), joined, starting, waited for."""
    kind = ev["event"]
    if kind == "starting":
        return f"membership: starting workers {ev['worker_ids']} on free slots (world of {ev['size']} now)"
    if kind == "waiting":
        return (
            f"membership: {len(ev['alive'])} workers alive, below min_workers={ev['min_workers']}: waiting up to "
            f"{ev['timeout_s']:g} s for {ev['need']} more"
        )
    if kind == "drain_seen":
        return f"membership: {_drain_head(ev, ev['left_s'])}: workers {ev['workers']} leave at the next step boundary"
    before, after = len(ev["world_before"]), len(ev["world_after"])
    layout = f"; {ev['layout']}" if ev.get("layout") else ""
    if ev["what"] == "drain":
        head = f"membership: {_drain_head(ev, ev['deadline_left_s'])}: workers {ev['workers']}"
        if ev.get("fallback"):
            return f"{head} stay: {ev['fallback']}"
        when = f"after step {ev['after_step']}" if ev["after_step"] >= 0 else "before the first step"
        return (
            f"{head} left {when} in {ev['recovery_ms'] / 1e3:.1f} s, nothing re-run (handoff "
            f"{ev['handoff_ms'] / 1e3:.1f} s of {ev['handoff_bytes'] / 1e6:.1f} MB, re-form {ev['reform_ms'] / 1e3:.1f}"
            f" s), world {before} -> {after}{layout}"
        )
    if ev.get("drain"):  # lost with a node that was being drained
        layout += f"; node {ev['drain']['node_ip'] or ev['drain']['node'][:12]} was draining: {ev['drain']['fallback']}"
    if ev["what"] == "grow":
        line = f"membership: workers {ev['joined']} joined, world {before} -> {after} ({ev['recovery_ms']:.0f} ms)"
        return line + layout
    if ev.get("rollback"):
        return (
            f"membership: {ev['what']}: {ev['reason']}; back to the checkpoint of step {ev['to_step']} (from step "
            f"{ev['from_step']}), world of {after} in {ev['recovery_ms']:.0f} ms{layout}"
        )
    redo = "the step's update had finished, kept" if ev["step_completed"] else "re-running the step"
    seen = ""
    if ev.get("detect_ms") is not None:
        by = "its heartbeat stopped" if ev.get("detected_by") == "heartbeat" else "Ray reported it"
        seen = f" (seen {ev['detect_ms'] / 1e3:.1f} s after its last heartbeat: {by})"
    return (
        f"membership: {ev['what']}: {ev['reason']}{seen}; {'/'.join(ev['decisions'])}, world {before} -> {after} "
        f"workers {ev['world_after']} in {ev['recovery_ms']:.0f} ms; {redo}{layout}"
    )


def _drain_head(ev: dict, left_s: float | None) -> str:
    """``node 10.0.0.7 draining (preemption, 45 s)``: the node, the drain's reason and the time to its deadline."""
    name = ev.get("node_ip") or ev["node"][:12]
    deadline = "no deadline" if left_s is None else f"{max(left_s, 0.0):.0f} s"
    return f"node {name} draining ({ev['reason']}, {deadline})"


def _describe_setup(ev: dict) -> str:
    st = ev["corpus"]
    parts = [f"{ev['num_docs']:,} documents", f"{st.get('tokens', 0):,} tokens"]
    if st.get("records_kind") not in (None, "text"):  # loss masks: say what the loss is taken over
        parts[0] = f"{ev['num_docs']:,} {st['records_kind'].replace('_', '/')} documents"
        parts.append(f"{st.get('targets', 0):,} of them loss targets{_chat_targets(st.get('chat_targets'))}")
    if st.get("tasks"):  # [[tasks]]: each task's documents and kind
        each = [
            f"{name} {t.get('documents', 0):,} {(t.get('records_kind') or 'text').replace('_', '/')} docs"
            for name, t in st["tasks"].items()
        ]
        parts[0] = f"{len(st['tasks'])} tasks ({'; '.join(each)}): {ev['num_docs']:,} documents"
        rule = next((t["chat_targets"] for t in st["tasks"].values() if t.get("chat_targets")), None)  # one tokenizer
        parts.append(f"{st.get('targets', 0):,} of them loss targets{_chat_targets(rule)}")
    for key, label in (
        ("split_docs", "split"),
        ("dropped_over_long", "over-long dropped"),
        ("skipped_binary", "binary skipped"),
        ("skipped_empty", "empty skipped"),
        ("bad_records", "bad records skipped"),
    ):
        if st.get(key):
            parts.append(f"{st[key]:,} {label}")
    resumed = f", resumed after step {ev['resumed_from']}" if ev.get("resumed_from") is not None else ""
    kernels = ev.get("kernels") or {}
    compiled = f"; {kernels['compiled_layers']} layers compiled" if kernels.get("compiled_layers") else ""
    attention = f"; {kernels['attention']}" if kernels.get("attention") else ""
    return (
        f"flexorch train: {ev['workers']} worker{'s' * (ev['workers'] != 1)} "
        f"(elastic {ev['min_workers']}..{ev['max_workers']}), "
        f"model {ev['model_params'] / 1e6:.2f}M params{_sharding(ev)}, corpus "
        f"{', '.join(parts)}; {ev['batches_per_epoch']} batches per epoch; profile {ev['profile']} "
        f"({_budget(ev)}){resumed}{attention}{compiled}"
    )


def _chat_targets(rule: str | None) -> str:
    """Which rule chose a chat corpus's loss targets (``stats["chat_targets"]``, ``flexorch.data.chat.target_rule``;
    nothing for a store prepared before it was recorded)."""
    from flexorch.data.chat import TARGET_RULES

    return f" (set by {TARGET_RULES[rule]})" if rule in TARGET_RULES else ""


def _budget(ev: dict) -> str:
    """The activation budget in tokens: a worker alone holds ``tokens_per_worker``; a worker of the costliest SP group
    (Ulysses's all-to-all copies) holds ``plan.tokens_per_worker``, fewer on a small model."""
    alone, group = ev["tokens_per_worker"], ev.get("group_tokens_per_worker")
    if group is None or group >= alone:
        return f"{alone:,} tokens per worker"
    return f"activations for {alone:,} tokens per worker alone, {group:,} in the costliest SP group"


def _sharding(ev: dict) -> str:
    sh = ev.get("sharding")
    if not sh:
        return ""
    ac = f", recompute {sh['activation_checkpointing']}" if sh["activation_checkpointing"] != "none" else ""
    over = f" over {sh['shards']}" if sh["mode"] != "replicate" else ""
    mib = sh["plan_resident_bytes"] / 2**20
    return f" ({sh['mode']}{over}, {sh['precision']}{ac}, {mib:.2f} MiB model state per worker)"


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
                    ray.kill(driver, no_restart=True)  # its workers and planner are its own actors: they go too
                    done = f"after step {view.completed}" if view.completed else "before its first step"
                    head = f"flexorch train: the driver was lost {done}: {lost.reason}"
                    allowed = cfg.elastic.driver_restarts
                    if stops.received or restarts >= allowed:
                        why = f"{stops.received} was received" if stops.received else f"driver_restarts = {allowed}"
                        raise DriverLostError(
                            f"the driver was lost {done} ({lost.reason}); not restarted ({why}). "
                            f"{view.checkpoint_words()}: go on with `{again}`"
                        ) from None
                    restarts += 1
                    print(
                        f"{head}; starting a new driver from {view.checkpoint_words().lower()} (restart {restarts} "
                        f"of {allowed})",
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
                    view = _RunView(earlier=view)
        finally:
            try:
                ray.get(driver.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - the driver may already be gone; kill it
                pass
            ray.kill(driver)


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
                _print_event(ev, cfg, out)
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


def _print_event(ev: dict, cfg: TrainConfig, out) -> None:
    kind = ev["event"]
    if kind == "setup":
        print(_describe_setup(ev), file=out, flush=True)
    elif kind in ("calibrated", "planner", "progress"):
        print(ev["message"], file=out, flush=True)
    elif kind == "checkpoint_skipped":
        print(f"--resume: {ev['message']}", file=out, flush=True)
    elif kind == "step":
        print(format_step(ev, cfg.steps), file=out, flush=True)
    elif kind in ("membership", "waiting", "starting", "drain_seen"):
        print(format_membership(ev), file=out, flush=True)
    elif kind == "capacity":
        print(f"membership: {ev['message']}", file=out, flush=True)
    elif kind == "checkpoint":
        print(f"checkpoint after step {ev['step']}: {ev['path']}", file=out, flush=True)


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
